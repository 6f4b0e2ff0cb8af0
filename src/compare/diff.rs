//! Two traces in, a verdict out: every stage both hold compared (values where both stored
//! them, statistics otherwise, id sets for top-k stages), each against a tolerance for the
//! candidate's dtype or calibrated on a noise envelope, the first divergent stage located,
//! its error set against its input's, and the fault classified from what the traces show.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use serde::Serialize;

use super::classify::classify;
use super::fault::{Fault, FaultClass};
use super::metrics::Metrics;
use super::unshard::{unshard, Sharding};
use crate::trace::{ElemType, StageRecord, Trace};

/// `rel_diff` two f32 computations of one forward stay under (different summation orders give
/// about 1e-12 on the reference's models).
pub const F32_TOLERANCE: f64 = 1e-8;

/// How far above the envelope's own departure a stage may go when calibrated.
pub const ENVELOPE_FACTOR: f64 = 10.0;

/// Default `rel_diff` tolerance for a candidate run at `dtype`.
pub fn default_tolerance(dtype: &str) -> f64 {
    match dtype {
        "bf16" => 1e-3,
        "f16" => 1e-4,
        _ => F32_TOLERANCE,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
}

/// What a stage's comparison rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Basis {
    /// Full tensors on both sides.
    Values,
    /// Statistics only: `rel_diff` is its lower bound from the two norms, and equal content
    /// hashes mean equal tensors.
    Stats,
    /// Top-k id sets per position (order within a position ignored).
    Ids,
}

/// One stage (or one rank's part of it) compared.
#[derive(Clone, Debug, Serialize)]
pub struct StageDiff {
    pub stage: String,
    pub layer: Option<u64>,
    pub rank: Option<u32>,
    pub status: Status,
    pub basis: Basis,
    /// `1 − 2Σxy/Σ(x²+y²)` (a lower bound on stats), or for ids the share of positions whose
    /// sets differ. The tolerance that would have passed this stage.
    pub rel_diff: f64,
    pub tolerance: f64,
    /// This stage's `rel_diff` over the previous stage's: ≫ 1 where the error is made here.
    pub amplification: Option<f64>,
    #[serde(flatten)]
    pub metrics: Option<Metrics>,
    /// Reference and candidate statistics, for the report.
    pub ref_absmax: f64,
    pub cand_absmax: f64,
    pub ref_nonfinite: u64,
    pub cand_nonfinite: u64,
}

/// Where the candidate first leaves its tolerance.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Divergence {
    pub stage: String,
    pub layer: Option<u64>,
    pub rank: Option<u32>,
}

/// The verdict, DESIGN §7's JSON.
#[derive(Clone, Debug, Serialize)]
pub struct DiffReport {
    pub verdict: Status,
    pub first_divergence: Option<Divergence>,
    pub fault: Option<Fault>,
    pub reference: String,
    pub candidate: String,
    pub candidate_dtype: String,
    /// `dtype default` or `envelope TRACE`.
    pub tolerance_source: String,
    /// The largest `rel_diff` of any value or stats stage: a tolerance under which this
    /// comparison would pass (id stages aside).
    pub tolerance_to_pass: f64,
    pub stages: Vec<StageDiff>,
}

/// Settings of a comparison.
#[derive(Default)]
pub struct DiffOptions<'a> {
    /// One `rel_diff` tolerance for every stage, overriding the defaults.
    pub tolerance: Option<f64>,
    /// The reference run again at the candidate's dtype: each stage's tolerance becomes
    /// [`ENVELOPE_FACTOR`] × its departure from the reference (at least [`F32_TOLERANCE`]).
    pub envelope: Option<&'a Trace>,
}

/// `L12.attn.q` → 12.
pub fn layer_of(stage: &str) -> Option<u64> {
    stage.strip_prefix('L')?.split('.').next()?.parse().ok()
}

/// A stage's whole values when the trace holds them (rank parts unsharded).
pub(crate) fn whole_values(trace: &Trace, name: &str) -> Result<Option<(Vec<f32>, Vec<u64>)>> {
    let records: Vec<&StageRecord> = trace.stages().iter().filter(|s| s.name == name).collect();
    if let Some(whole) = records.iter().find(|s| s.rank.is_none()) {
        return Ok(trace.tensor(name, None)?.map(|v| (v, whole.shape.clone())));
    }
    let mut parts = Vec::new();
    let mut shapes = Vec::new();
    let mut ranks: Vec<&&StageRecord> = records.iter().collect();
    ranks.sort_by_key(|s| s.rank);
    for s in &ranks {
        match trace.tensor(name, s.rank)? {
            Some(v) => parts.push(v),
            None => return Ok(None),
        }
        shapes.push(s.shape.clone());
    }
    if parts.is_empty() {
        return Ok(None);
    }
    let sharding = Sharding::of(&ranks[0].dims)?;
    Ok(Some(
        unshard(&sharding, &parts, &shapes).with_context(|| format!("stage {name}"))?,
    ))
}

/// Per position, the sorted id set of an `[t, k]` id stage.
fn id_sets(values: &[f32], shape: &[u64]) -> Vec<Vec<i64>> {
    let k = shape.last().copied().unwrap_or(1).max(1) as usize;
    values
        .chunks(k)
        .map(|row| {
            let mut s: Vec<i64> = row.iter().map(|&v| v as i64).collect();
            s.sort_unstable();
            s
        })
        .collect()
}

/// Compare two sides of one stage: `rel_diff`, the basis, and the metrics when values exist.
fn measure(
    reference: &Trace,
    candidate: &Trace,
    r: &StageRecord,
    c: &StageRecord,
) -> Result<(f64, Basis, Option<Metrics>)> {
    let values = |t: &Trace, rank| -> Result<Option<Vec<f32>>> {
        Ok(match rank {
            Some(rank) => t.tensor(&r.name, Some(rank))?,
            None => whole_values(t, &r.name)?.map(|(v, _)| v),
        })
    };
    let (rv, cv) = if r.shape == c.shape {
        (values(reference, r.rank)?, values(candidate, c.rank)?)
    } else {
        (None, None)
    };
    if r.dtype == ElemType::I32 {
        return Ok(match (rv, cv) {
            (Some(x), Some(y)) => {
                let (a, b) = (id_sets(&x, &r.shape), id_sets(&y, &c.shape));
                let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
                (differ as f64 / a.len().max(1) as f64, Basis::Ids, None)
            }
            _ => (
                if r.stats.hash == c.stats.hash && r.shape == c.shape {
                    0.0
                } else {
                    1.0
                },
                Basis::Ids,
                None,
            ),
        });
    }
    if let (Some(x), Some(y)) = (rv, cv) {
        let m = Metrics::of(&x, &y);
        return Ok((m.rel_diff, Basis::Values, Some(m)));
    }
    // Stats: equal hashes are equal tensors; otherwise the norms bound rel_diff from below.
    let bound = if r.stats.hash == c.stats.hash && r.shape == c.shape {
        0.0
    } else if r.shape != c.shape {
        1.0
    } else {
        let (a, b) = (r.stats.l2, c.stats.l2);
        if a * a + b * b > 0.0 {
            (a - b).powi(2) / (a * a + b * b)
        } else {
            0.0
        }
    };
    Ok((bound, Basis::Stats, None))
}

/// The stage pairs to compare, in the reference's recording order: whole tensors, then rank
/// by rank where both sides recorded the same ranks.
fn pairs<'t>(
    reference: &'t Trace,
    candidate: &'t Trace,
) -> Vec<(&'t StageRecord, &'t StageRecord)> {
    let mut by_name: BTreeMap<(&str, Option<u32>), &StageRecord> = BTreeMap::new();
    for s in candidate.stages() {
        by_name.insert((s.name.as_str(), s.rank), s);
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for r in reference.stages() {
        // Top-k boundary gaps explain near-ties; they are not outputs to judge.
        if r.name.ends_with("_gap") || !seen.insert(r.name.as_str()) {
            continue;
        }
        // A whole record stands for the stage; rank parts are unsharded when values exist.
        let whole = |t: &'t Trace| {
            t.stages()
                .iter()
                .find(|s| s.name == r.name && s.rank.is_none())
                .or_else(|| t.stages().iter().find(|s| s.name == r.name))
        };
        if let (Some(rw), Some(cw)) = (whole(reference), whole(candidate)) {
            out.push((rw, cw));
        }
        for rr in reference
            .stages()
            .iter()
            .filter(|s| s.name == r.name && s.rank.is_some())
        {
            if let Some(cr) = by_name.get(&(r.name.as_str(), rr.rank)) {
                out.push((rr, *cr));
            }
        }
    }
    out
}

/// Compare `candidate` against `reference`.
pub fn diff(reference: &Trace, candidate: &Trace, opts: &DiffOptions) -> Result<DiffReport> {
    let cand_dtype = candidate.manifest().dtype.clone();
    let default = opts
        .tolerance
        .unwrap_or_else(|| default_tolerance(&cand_dtype));
    let mut stages = Vec::new();
    let mut prev_rel: Option<f64> = None;
    for (r, c) in pairs(reference, candidate) {
        let rank = if r.rank.is_some() { r.rank } else { None };
        let (rel_diff, basis, metrics) = measure(reference, candidate, r, c)?;
        let tolerance = match (opts.envelope, opts.tolerance) {
            (Some(env), None) => envelope_tolerance(reference, env, r)?,
            _ => default,
        };
        let new_non_finite = c.stats.nan + c.stats.inf > r.stats.nan + r.stats.inf;
        let status = if rel_diff > tolerance || new_non_finite || r.shape != c.shape {
            Status::Fail
        } else {
            Status::Pass
        };
        let amplification = match (basis, prev_rel) {
            (Basis::Ids, _) | (_, None) => None,
            (_, Some(p)) => Some(rel_diff / p.max(1e-30)),
        };
        if basis != Basis::Ids && rank.is_none() {
            prev_rel = Some(rel_diff);
        }
        stages.push(StageDiff {
            layer: layer_of(&r.name),
            stage: r.name.clone(),
            rank,
            status,
            basis,
            rel_diff,
            tolerance,
            amplification,
            metrics,
            ref_absmax: r.stats.absmax,
            cand_absmax: c.stats.absmax,
            ref_nonfinite: r.stats.nan + r.stats.inf,
            cand_nonfinite: c.stats.nan + c.stats.inf,
        });
    }
    let first = stages.iter().position(|s| s.status == Status::Fail);
    let fault = match first {
        Some(i) => Some(classify(
            reference,
            candidate,
            &stages,
            i,
            opts.envelope.is_some(),
        )?),
        None => beyond_f32(&stages),
    };
    Ok(DiffReport {
        verdict: if first.is_some() {
            Status::Fail
        } else {
            Status::Pass
        },
        first_divergence: first.map(|i| Divergence {
            stage: stages[i].stage.clone(),
            layer: stages[i].layer,
            rank: stages[i].rank,
        }),
        fault,
        reference: reference.dir().display().to_string(),
        candidate: candidate.dir().display().to_string(),
        candidate_dtype: cand_dtype,
        tolerance_source: match (opts.tolerance, opts.envelope) {
            (Some(t), _) => format!("--tolerance {t:e}"),
            (None, Some(env)) => format!("envelope {}", env.dir().display()),
            (None, None) => "dtype default".into(),
        },
        tolerance_to_pass: stages
            .iter()
            .filter(|s| s.basis != Basis::Ids)
            .map(|s| s.rel_diff)
            .fold(0.0, f64::max),
        stages,
    })
}

/// A stage's calibrated tolerance: the envelope's own departure from the reference there, times
/// [`ENVELOPE_FACTOR`], never below [`F32_TOLERANCE`].
fn envelope_tolerance(reference: &Trace, envelope: &Trace, r: &StageRecord) -> Result<f64> {
    let Some(e) = envelope
        .stages()
        .iter()
        .find(|s| s.name == r.name && s.rank == r.rank)
        .or_else(|| envelope.stages().iter().find(|s| s.name == r.name))
    else {
        return Ok(default_tolerance(&envelope.manifest().dtype));
    };
    let (env_rel, _, _) = measure(reference, envelope, r, e)?;
    Ok((ENVELOPE_FACTOR * env_rel).max(F32_TOLERANCE))
}

/// A passing comparison whose stages still exceed f32 noise: precision, not a bug.
fn beyond_f32(stages: &[StageDiff]) -> Option<Fault> {
    let worst = stages
        .iter()
        .filter(|s| s.basis != Basis::Ids)
        .max_by(|a, b| a.rel_diff.total_cmp(&b.rel_diff))?;
    (worst.rel_diff > F32_TOLERANCE).then(|| Fault {
        class: FaultClass::PrecisionLoss,
        summary: format!(
            "every stage within tolerance; the largest departure, {:.2e} at {}, is beyond f32 \
             noise",
            worst.rel_diff, worst.stage
        ),
        evidence: vec![format!(
            "rel_diff {:e} at {} (f32 noise ≤ {:e})",
            worst.rel_diff, worst.stage, F32_TOLERANCE
        )],
        weight: None,
    })
}
