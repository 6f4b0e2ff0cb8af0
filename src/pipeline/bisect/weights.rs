//! A conversion's weights in bisect: every tensor of the candidate checked against the
//! reference with `verify` before anything runs, so that a corrupted tensor fails the run even
//! where the activations stay inside the envelope (4-bit noise flips routing, and a tolerance
//! built from that can swallow a doubled weight). A file too large to read whole in reasonable
//! time is checked where the traces diverge instead; the report says which.

use std::time::Instant;

use anyhow::Result;
use globset::{Glob, GlobSetBuilder};

use super::WeightsInfo;
use crate::compare::diff::Divergence;
use crate::compare::{DiffReport, Fault, Status};
use crate::exec::source::WeightSource;
use crate::model::names::WeightId;
use crate::model::stage::layer_of;
use crate::model::stages::{stage_names, stage_of, stage_weights};
use crate::model::Glm5Config;
use crate::pipeline::Model;
use crate::verify::{verify, Finding, Options, VerifyReport};

/// Under `auto`, candidates larger than this are checked at the divergent stage only.
const CHECK_ALL_BYTES: u64 = 32 << 30;

/// Which of a conversion's weights bisect checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightCheck {
    /// All of them up to 32 GiB of candidate files, else those of the divergent stage.
    Auto,
    /// Every tensor, before the runs.
    All,
    /// Only the tensors the first divergent stage reads.
    Divergent,
    /// None.
    Off,
}

impl WeightCheck {
    pub const ALL: [WeightCheck; 4] = [
        WeightCheck::Auto,
        WeightCheck::All,
        WeightCheck::Divergent,
        WeightCheck::Off,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WeightCheck::Auto => "auto",
            WeightCheck::All => "all",
            WeightCheck::Divergent => "divergent",
            WeightCheck::Off => "off",
        }
    }
}

impl WeightsInfo {
    fn of(checked: &'static str, r: VerifyReport, started: Instant) -> Self {
        WeightsInfo {
            checked,
            tensors: r.summary.tensors,
            exact: r.summary.exact,
            within_noise: r.summary.within_noise,
            failed: r.summary.failed,
            bytes_read: r.tensors.iter().map(|t| t.bytes).sum(),
            seconds: started.elapsed().as_secs_f64(),
            findings: r.findings,
        }
    }
}

/// Whether `mode` checks every tensor of the candidate `cand` before the runs.
pub fn check_all(mode: WeightCheck, cand: &Model) -> bool {
    let size: u64 = cand.files.tensors().iter().map(|t| t.nbytes).sum();
    match mode {
        WeightCheck::All => true,
        WeightCheck::Auto => size <= CHECK_ALL_BYTES,
        WeightCheck::Divergent | WeightCheck::Off => false,
    }
}

/// Every tensor of the candidate against the reference.
pub fn check_every_tensor(model: &Model, cand_model: &Model) -> Result<WeightsInfo> {
    let started = Instant::now();
    let (reference, cand) = (model.source(), cand_model.source());
    let report = verify(
        &reference,
        &cand,
        &Options {
            select: None,
            strict: false,
            progress: &|_, _| {},
        },
    )?;
    Ok(WeightsInfo::of("all", report, started))
}

/// The candidate's tensors behind `ids` against the reference.
pub fn check_tensors_of(
    model: &Model,
    cand_model: &Model,
    ids: &[WeightId],
) -> Result<WeightsInfo> {
    let started = Instant::now();
    let (reference, cand) = (model.source(), cand_model.source());
    let mut globs = GlobSetBuilder::new();
    for name in tensor_names(&cand, ids) {
        globs.add(Glob::new(&globset::escape(&name))?);
    }
    let select = globs.build()?;
    let report = verify(
        &reference,
        &cand,
        &Options {
            select: Some(&select),
            strict: false,
            progress: &|_, _| {},
        },
    )?;
    Ok(WeightsInfo::of("divergent", report, started))
}

/// The stored tensors of `src` behind `ids` (stacked experts under their layer's roles).
fn tensor_names(src: &WeightSource, ids: &[WeightId]) -> Vec<String> {
    ids.iter().flat_map(|&id| src.tensor_names(id)).collect()
}

/// The stage a finding's tensor feeds first, in the forward's order.
fn stage_fed(cfg: &Glm5Config, cand: &WeightSource, f: &Finding) -> Option<String> {
    let id = crate::model::schema::role(cand.layout().family, &f.tensor)?;
    match id {
        WeightId::Embed => Some("embed".into()),
        WeightId::FinalNorm => Some("final_norm".into()),
        WeightId::LmHead => Some("logits".into()),
        WeightId::Layer(l, w) => stage_of(cfg, l, w).or_else(|| {
            // The split and fused forms feed the stage of their whole weight.
            use crate::model::names::LayerWeight as W;
            let whole = match w {
                W::KB | W::VB => W::KvB,
                W::ExpertsGateUp => W::ExpertsGate,
                other => other,
            };
            stage_of(cfg, l, whole)
        }),
        WeightId::Expert { layer, which, .. } => stage_of(cfg, layer, which),
    }
}

/// The finding as a diagnosis.
fn fault_of(f: &Finding) -> Fault {
    let mut evidence = f.evidence.clone();
    evidence.push(format!(
        "{}: {} (glmcheck verify against the reference, re-stored in the candidate's type)",
        f.tensor,
        f.relation.name()
    ));
    Fault {
        class: f.class,
        summary: f.summary.clone(),
        evidence,
        weight: Some(f.tensor.clone()),
    }
}

/// Give `report` what the weight check found: at the divergent stage, the finding among that
/// stage's weights names the fault; where the traces passed, the finding fails the run at the
/// stage its tensor feeds first. Returns whether a finding decided the diagnosis.
pub fn apply(
    report: &mut DiffReport,
    info: &WeightsInfo,
    model: &Model,
    cand_model: &Model,
    merge: impl Fn(Option<Fault>, Fault) -> Fault,
) -> Result<bool> {
    if info.findings.is_empty() {
        return Ok(false);
    }
    let cand = cand_model.source();
    let cfg = &model.cfg;
    let order = stage_names(cfg);
    let rank = |s: &Option<String>| {
        s.as_ref()
            .and_then(|s| order.iter().position(|o| o == s))
            .unwrap_or(usize::MAX)
    };
    let mut fed: Vec<(Option<String>, &Finding)> = info
        .findings
        .iter()
        .map(|f| (stage_fed(cfg, &cand, f), f))
        .collect();
    fed.sort_by_key(|(s, _)| rank(s));
    match report.first_divergence.clone() {
        Some(d) => {
            // A finding upstream of (or at) the divergence explains it: the first in the
            // forward's order is the cause.
            let names = tensor_names(&cand, &stage_weights(cfg, &d.stage));
            let at = order
                .iter()
                .position(|o| *o == d.stage)
                .unwrap_or(usize::MAX);
            let cause = fed
                .iter()
                .find(|(s, f)| rank(s) < at || names.contains(&f.tensor));
            let Some((stage, f)) = cause else {
                // Found only downstream: the traces' diagnosis stands, the check beside it.
                if let Some(fault) = &mut report.fault {
                    for (stage, f) in &fed {
                        fault.evidence.push(format!(
                            "the weight check also found {} ({}, {}) feeding {}",
                            f.tensor,
                            f.class.name(),
                            f.relation.name(),
                            stage.as_deref().unwrap_or("no recorded stage")
                        ));
                    }
                }
                return Ok(false);
            };
            let mut fault = fault_of(f);
            if let Some(s) = stage.as_ref().filter(|s| **s != d.stage) {
                fault.evidence.push(format!(
                    "{} feeds {s}, upstream of the first divergence at {}",
                    f.tensor, d.stage
                ));
            }
            report.fault = Some(merge(report.fault.take(), fault));
        }
        None => {
            let (stage, f) = &fed[0];
            let stage = stage.clone().unwrap_or_else(|| "embed".into());
            report.verdict = Status::Fail;
            report.first_divergence = Some(Divergence {
                layer: layer_of(&stage),
                stage,
                rank: None,
            });
            let mut fault = fault_of(f);
            fault.evidence.push(
                "the activations stayed inside the noise envelope; the weight check alone fails \
                 the run"
                    .into(),
            );
            report.fault = Some(fault);
        }
    }
    Ok(true)
}
