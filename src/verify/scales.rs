//! FP8 block scales against the format the candidate declares. Where its config says
//! `quantization_config.scale_fmt: "ue8m0"` (DeepSeek-V3.1), and wherever scales are stored as
//! F8_E8M0, every scale must be a UE8M0 value, 2^k: DeepGEMM's UE8M0 kernels keep only a
//! scale's exponent bits, so any other scale is silently rounded there while glmcheck, torch and
//! every other reader use it as stored.

use anyhow::{anyhow, Context, Result};

use super::relation::{class_of, Finding, Relation};
use super::{Status, TensorCheck};
use crate::compare::FaultClass;
use crate::exec::source::WeightSource;
use crate::model::schema::role;
use crate::weights::fp8::{is_ue8m0, ScaleFmt};
use crate::weights::{Encoding, TensorEntry};

/// The format `cand`'s `config.json` declares for its block scales (`Float` without one).
pub fn declared(cand: &WeightSource) -> Result<ScaleFmt> {
    let Some(path) = cand.files.hf_config_path() else {
        return Ok(ScaleFmt::Float);
    };
    let name = || path.display().to_string();
    let text = std::fs::read_to_string(&path).with_context(name)?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(name)?;
    ScaleFmt::of_config(&json).map_err(|why| anyhow!("{}: {why}", name()))
}

/// Whether `t` is block scales that must be UE8M0 values in a checkpoint declaring `fmt`.
pub fn must_be_ue8m0(t: &TensorEntry, fmt: ScaleFmt) -> bool {
    t.name.ends_with("_scale_inv") && (fmt == ScaleFmt::Ue8m0 || t.encoding == Encoding::F8E8M0)
}

/// The line of scales `t` and, when one of them is no UE8M0 value, the finding naming the first.
pub fn check(
    cand: &WeightSource,
    t: &TensorEntry,
    fmt: ScaleFmt,
) -> Result<(TensorCheck, Option<Finding>)> {
    let mut line = TensorCheck::new(t);
    let values = cand.files.dequantize(t)?;
    let mut bad = values.iter().enumerate().filter(|(_, v)| !is_ue8m0(**v));
    let Some((at, &v)) = bad.next() else {
        line.why = Some("block scales, every one a power of two (UE8M0)".into());
        return Ok((line, None));
    };
    let count = 1 + bad.count();
    line.status = Status::Fail;
    line.why = Some(format!("{count} scales not a power of two"));
    let relation = Relation::ScaleFormat;
    let class = role(cand.layout().family, &t.name).map_or(FaultClass::ScaleMismatch, |id| {
        class_of(relation, id, false)
    });
    let because = match fmt {
        ScaleFmt::Ue8m0 => "the config's scale_fmt \"ue8m0\"",
        ScaleFmt::Float => "its F8_E8M0 dtype",
    };
    let cols = t.row_len().max(1) as usize;
    let mut evidence = vec![format!(
        "{}: scale {at} (block row {}, column {}) is {v:e}, not 2^k for any -127 ≤ k ≤ 127",
        t.name,
        at / cols,
        at % cols
    )];
    if v.is_normal() && v > 0.0 {
        // What a reader keeping only the exponent bits (DeepGEMM's `bits >> 23`) uses instead.
        let kept = f32::from_bits(v.to_bits() & 0x7f80_0000);
        evidence.push(format!(
            "{}: a UE8M0 reader keeps its exponent only, {kept:e}: that block's weights × {:.4}",
            t.name,
            kept / v
        ));
    }
    let finding = Finding {
        tensor: t.name.clone(),
        class,
        relation,
        summary: format!(
            "{} ({}): {count} of {} block scales are not powers of two, as {because} requires",
            t.name,
            t.encoding,
            values.len()
        ),
        evidence,
        factor: None,
        map: Vec::new(),
        with: None,
    };
    Ok((line, Some(finding)))
}
