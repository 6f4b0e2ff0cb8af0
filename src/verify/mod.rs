//! Every tensor of a candidate checkpoint against the reference checkpoint it was made from.
//!
//! For each stored tensor of the candidate (a GGUF of any type, a safetensors checkpoint), the
//! reference's values are laid out as the candidate stores them ([`units`]), stored again in the
//! candidate's type with ggml's own quantizer, and compared segment by segment ([`segments`]):
//! bytes equal to that re-quantization are `exact`; a segment within the type's noise of the
//! reference (another quantizer's choices, an importance matrix) is `noise`; anything past it is
//! a departure, explained by the relation it bears to the reference ([`relation`]) and classed
//! by that relation and the weight's role. Memory stays at one unit (an expert, a block of
//! rows) whatever the model's size. FP8 block scales are held to the format the candidate's
//! config declares ([`scales`]).

mod kv_b;
pub mod relation;
pub mod scales;
pub mod segments;
pub mod units;

use anyhow::Result;
use globset::GlobSet;
use serde::Serialize;

use crate::exec::source::WeightSource;
use crate::model::schema;
use crate::weights::{Encoding, TensorEntry};
pub use relation::{Finding, Relation};
use segments::{compare, Sums, UnitStats};
use units::{both, candidate_bytes, plan, Mismatch, Plan};

/// A whole tensor whose least-squares factor to the reference re-stored in its type is further
/// from 1 than this is scaled, even where each segment stays within the band (a 5% scale
/// error hides inside 4-bit noise segment by segment). Honest files give exactly 1 without an
/// importance matrix, and within 0.7% of it with one (llama.cpp's imatrix Q4_K_M).
const SCALE_TOLERANCE: f64 = 0.02;

/// What one candidate tensor showed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every block re-quantized (all with `--exact`, else a sample and every block whose
    /// verdict needed it) is the bytes glmcheck's (ggml's) quantization of the reference gives.
    Exact,
    /// Not those bytes everywhere, but every segment within the type's noise.
    Noise,
    Fail,
    Skipped,
}

/// One candidate tensor's line of the report.
#[derive(Clone, Debug, Serialize)]
pub struct TensorCheck {
    pub tensor: String,
    #[serde(rename = "type")]
    pub ty: String,
    pub shape: Vec<u64>,
    pub status: Status,
    /// rel_diff of the candidate against the reference, and of the reference re-stored in the
    /// candidate's type (its noise).
    pub rel_diff: f64,
    pub noise: f64,
    pub blocks: u64,
    /// Blocks the reference's values were re-quantized for, and of those the ones whose bytes
    /// are the re-quantization's.
    pub blocks_requantized: u64,
    pub blocks_exact: u64,
    /// Segments (256 values) past the band.
    pub blocks_beyond: u64,
    /// The largest departure of a segment over its type's noise (a fault past 8).
    pub worst: f64,
    /// Σqc/Σq² over the re-quantized sample: the least-squares factor between the candidate
    /// and the reference re-stored in its type (1 for an honest file; absent without a
    /// quantizer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    #[serde(skip)]
    pub bytes: u64,
}

impl TensorCheck {
    /// The line of `t` before it is checked: skipped, nothing measured.
    fn new(t: &TensorEntry) -> Self {
        TensorCheck {
            tensor: t.name.clone(),
            ty: t.encoding.name().to_string(),
            shape: t.shape.clone(),
            status: Status::Skipped,
            rel_diff: 0.0,
            noise: 0.0,
            blocks: 0,
            blocks_requantized: 0,
            blocks_exact: 0,
            blocks_beyond: 0,
            worst: 0.0,
            factor: None,
            why: None,
            bytes: t.nbytes,
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    pub tensors: usize,
    pub exact: usize,
    pub within_noise: usize,
    pub failed: usize,
    pub skipped: usize,
    /// Blocks checked, and those re-quantized from the reference to judge them.
    pub blocks: u64,
    pub blocks_requantized: u64,
}

/// The whole check.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub verdict: crate::compare::Status,
    pub reference: String,
    pub candidate: String,
    /// The candidate GGUF says it was quantized with an importance matrix (`quantize.imatrix.*`):
    /// its bytes are not expected to be ggml's plain quantization.
    pub candidate_imatrix: bool,
    /// `--exact`: every block had to be the re-quantization's bytes.
    pub exact_required: bool,
    pub summary: Summary,
    pub tensors: Vec<TensorCheck>,
    pub findings: Vec<Finding>,
}

/// Which tensors to check and how strictly.
pub struct Options<'a> {
    pub select: Option<&'a GlobSet>,
    pub strict: bool,
    /// Called with each tensor's byte size once it is checked (progress).
    pub progress: &'a dyn Fn(&str, u64),
}

/// Whether the candidate GGUF records an importance matrix.
pub fn uses_imatrix(cand: &WeightSource) -> bool {
    cand.files.gguf().is_some_and(|g| {
        g.metadata()
            .iter()
            .any(|(k, _)| k.starts_with("quantize.imatrix."))
    })
}

/// The tensors of `cand` [`verify`] would check with `select`.
pub fn selected<'a>(cand: &'a WeightSource, select: Option<&GlobSet>) -> Vec<&'a TensorEntry> {
    cand.files
        .tensors()
        .iter()
        .filter(|t| select.is_none_or(|s| s.is_match(&t.name)))
        .collect()
}

/// Check the tensors of `cand` that `opts` selects against `reference`.
pub fn verify(
    reference: &WeightSource,
    cand: &WeightSource,
    opts: &Options,
) -> Result<VerifyReport> {
    let expected = schema::expected(&reference.cfg, cand.layout());
    let scale_fmt = scales::declared(cand)?;
    let mut tensors = Vec::new();
    let mut findings = Vec::new();
    for t in selected(cand, opts.select) {
        let want = expected.iter().find(|e| e.name == t.name).map(|e| &e.shape);
        let (check, finding) = if scales::must_be_ue8m0(t, scale_fmt) {
            scales::check(cand, t, scale_fmt)?
        } else {
            check_tensor(reference, cand, t, want, opts.strict)?
        };
        (opts.progress)(&t.name, t.nbytes);
        tensors.push(check);
        findings.extend(finding);
    }
    kv_b::regroup(reference, cand, &mut findings)?;
    let count = |s: Status| tensors.iter().filter(|t| t.status == s).count();
    let summary = Summary {
        tensors: tensors.len(),
        exact: count(Status::Exact),
        within_noise: count(Status::Noise),
        failed: count(Status::Fail),
        skipped: count(Status::Skipped),
        blocks: tensors.iter().map(|t| t.blocks).sum(),
        blocks_requantized: tensors.iter().map(|t| t.blocks_requantized).sum(),
    };
    Ok(VerifyReport {
        verdict: if findings.is_empty() {
            crate::compare::Status::Pass
        } else {
            crate::compare::Status::Fail
        },
        reference: reference.files.path.display().to_string(),
        candidate: cand.files.path.display().to_string(),
        candidate_imatrix: uses_imatrix(cand),
        exact_required: opts.strict,
        summary,
        tensors,
        findings,
    })
}

/// One candidate tensor: its line, and what explains a departure.
pub fn check_tensor(
    reference: &WeightSource,
    cand: &WeightSource,
    t: &TensorEntry,
    expected_shape: Option<&Vec<u64>>,
    strict: bool,
) -> Result<(TensorCheck, Option<Finding>)> {
    let mut line = TensorCheck::new(t);
    let p = match plan(reference, cand, t) {
        Ok(p) => p,
        Err(skip) => {
            line.why = Some(skip.why());
            return Ok((line, None));
        }
    };
    let numel_expected = expected_shape.map(|s| s.iter().product::<u64>());
    if let (Some(want), Some(n)) = (expected_shape, numel_expected) {
        if n != t.numel() {
            line.status = Status::Fail;
            return Ok((line, Some(shape_finding(&p, want))));
        }
    }
    let ty = match t.encoding {
        Encoding::Ggml(ty) => Some(ty),
        _ => None,
    };
    let mut stats: Vec<UnitStats> = Vec::with_capacity(p.units.len());
    for u in &p.units {
        let (x, c) = match both(reference, cand, t, u) {
            Ok(v) => v,
            Err(Mismatch::Count(why)) => {
                line.status = Status::Fail;
                let want = expected_shape.cloned().unwrap_or_default();
                let mut f = shape_finding(&p, &want);
                f.evidence.push(why);
                return Ok((line, Some(f)));
            }
            Err(Mismatch::Read(e)) => return Err(e),
        };
        let stored = candidate_bytes(cand, t, u);
        stats.push(compare(ty, t.row_len() as usize, &x, &c, stored, strict)?);
        // The bytes were read through the map: let them go, or the process keeps every page.
        cand.files.release_rows(t, u.rows.clone());
    }
    let (mut sums, mut sample) = (Sums::default(), Sums::default());
    for s in &stats {
        sums.add(&s.sums);
        sample.add(&s.sample);
        line.blocks += s.blocks;
        line.blocks_requantized += s.blocks_requantized;
        line.blocks_exact += s.blocks_exact;
        line.blocks_beyond += s.beyond;
        line.worst = line.worst.max(s.worst);
    }
    line.factor = (sample.qq > 0.0).then(|| sample.qc / sample.qq);
    line.rel_diff = sums.rel_diff();
    line.noise = sample.noise();
    let departs = stats.iter().any(|s| s.beyond > 0 || s.nonfinite > 0);
    if let Some(factor) = line
        .factor
        .filter(|f| !departs && (f - 1.0).abs() > SCALE_TOLERANCE)
    {
        line.status = Status::Fail;
        return Ok((line, Some(scaled_finding(&p, factor, &sums, &sample))));
    }
    if !departs {
        line.status = if line.blocks_requantized > 0 && line.blocks_exact == line.blocks_requantized
        {
            Status::Exact
        } else {
            Status::Noise
        };
        return Ok((line, None));
    }
    line.status = Status::Fail;
    let finding = relation::Departure {
        reference,
        cand,
        plan: &p,
        stats: &stats,
        strict,
    }
    .explain()?;
    Ok((line, Some(finding)))
}

/// A whole tensor that is the re-stored reference times `factor`, each segment within the band.
fn scaled_finding(p: &Plan, factor: f64, sums: &Sums, sample: &Sums) -> Finding {
    let t = p.tensor;
    let relation = Relation::ScalarMultiple;
    Finding {
        tensor: t.name.clone(),
        class: relation::class_of(relation, p.id, true),
        relation,
        summary: format!(
            "{} ({}): the reference's values times {factor:.4}",
            t.name,
            t.encoding.name()
        ),
        evidence: vec![format!(
            "{}: candidate = {factor:.6} × the reference stored as {} by ggml's quantizer \
             (an honest file is within {SCALE_TOLERANCE} of 1); rel_diff {:.3e} against a noise \
             of {:.3e}",
            t.name,
            t.encoding.name(),
            sums.rel_diff(),
            sample.noise()
        )],
        factor: Some(factor),
        map: Vec::new(),
        with: None,
    }
}

/// A tensor whose shape holds another number of values than the config gives.
fn shape_finding(p: &Plan, want: &[u64]) -> Finding {
    let t = p.tensor;
    let relation = Relation::Shape;
    Finding {
        tensor: t.name.clone(),
        class: relation::class_of(relation, p.id, true),
        relation,
        summary: format!("{}: another shape than the config gives", t.name),
        evidence: vec![format!(
            "{}: {:?} in the candidate; the config gives {:?}",
            t.name, t.shape, want
        )],
        factor: None,
        map: Vec::new(),
        with: None,
    }
}
