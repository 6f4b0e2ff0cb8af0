//! Two traces in, a verdict out: every stage both hold compared (values where both stored
//! them, statistics otherwise, id sets for top-k stages), each against a tolerance for the
//! candidate's dtype or calibrated on a noise envelope, the first divergent stage located,
//! its error set against its input's, and the fault classified from what the traces show.

use anyhow::Result;
use serde::Serialize;

use super::classify::classify;
use super::fault::{Fault, FaultClass};
use super::metrics::Metrics;
use super::stage_diff::{whole_values, Basis, Side, StageDiff, Status};
use super::unshard::{Block, Sharding};
use crate::model::stage::layer_of;
use crate::model::stage::{is_gaps, Stage};
use crate::trace::stats::sketch;
use crate::trace::{ElemType, StageRecord, TensorStats, Trace};

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

/// Where the candidate first leaves its tolerance.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Divergence {
    pub stage: String,
    pub layer: Option<u64>,
    pub rank: Option<u32>,
}

/// The verdict, docs/design.md §7's JSON.
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
    /// Which traces a run left unfinished: only the stages both hold are compared, and the
    /// verdict is never a pass.
    pub partial: Partial,
    pub stages: Vec<StageDiff>,
}

/// Which sides of a comparison are partial traces (`"complete": false` in their manifest).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Partial {
    pub reference: bool,
    pub candidate: bool,
}

impl Partial {
    pub fn of(reference: &Trace, candidate: &Trace) -> Partial {
        Partial {
            reference: !reference.manifest().complete,
            candidate: !candidate.manifest().complete,
        }
    }

    pub fn any(self) -> bool {
        self.reference || self.candidate
    }

    /// `reference and candidate`, `candidate`…: the partial sides, for a sentence.
    pub fn sides(self) -> String {
        match (self.reference, self.candidate) {
            (true, true) => "reference and candidate".into(),
            (true, false) => "reference".into(),
            (false, true) => "candidate".into(),
            (false, false) => "none".into(),
        }
    }
}

/// Settings of a comparison.
#[derive(Default)]
pub struct DiffOptions<'a> {
    /// One `rel_diff` tolerance for every stage, overriding the defaults.
    pub tolerance: Option<f64>,
    /// The reference run again at the candidate's dtype: each stage's tolerance becomes
    /// [`ENVELOPE_FACTOR`] × its departure from the reference (at least [`rounding_floor`]).
    pub envelope: Option<&'a Trace>,
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

/// One stage (`rank` None: the whole tensor, parts unsharded) compared between two traces.
struct Measured {
    rel_diff: f64,
    basis: Basis,
    /// Top-k ids kept as statistics only, of one shape on both sides, whose hashes differ:
    /// another choice somewhere, but not how many positions changed.
    ids_uncounted: bool,
    metrics: Option<Metrics>,
    shape: Vec<u64>,
    reference: Side,
    candidate: Side,
}

/// A side's values of `name` at `rank` (None: the whole tensor) with their shape; routing
/// weights in the order of their expert ids, as the ids are compared as sets (engines list the
/// chosen experts in score order, which a near tie may swap). A side holding the stage whole
/// gives a rank's `block` of it.
fn side_values(
    t: &Trace,
    name: &str,
    rank: Option<u32>,
    block: Option<&Block>,
) -> Result<Option<(Vec<f32>, Vec<u64>)>> {
    if let (Some(b), Some(_)) = (block, rank) {
        if t.stage(name, rank).is_none() {
            return Ok(whole_values(t, name)?.and_then(|(v, shape)| b.take(&v, &shape)));
        }
    }
    match (rank, routing_ids_beside(name)) {
        (None, Some(ids_name)) => {
            let ids = match t.stage(&ids_name, None) {
                Some(_) => whole_values(t, &ids_name)?,
                None => None,
            };
            Ok(whole_values(t, name)?.map(|(w, shape)| match ids {
                Some((ids, _)) if ids.len() == w.len() => {
                    let k = shape.last().copied().unwrap_or(1).max(1) as usize;
                    (in_id_order(&w, &ids, k), shape)
                }
                _ => (w, shape),
            }))
        }
        (None, None) => whole_values(t, name),
        (Some(r), _) => {
            let shape = t
                .stage(name, Some(r))
                .map(|s| s.shape.clone())
                .unwrap_or_default();
            Ok(t.tensor(name, Some(r))?.map(|v| (v, shape)))
        }
    }
}

/// The expert ids stage beside routing weights stage `name`; `None` for other stages.
fn routing_ids_beside(name: &str) -> Option<String> {
    let weights = Stage::parse(name).filter(|s| s.kind() == "moe.topk_weights")?;
    Some(weights.sibling("moe.topk_ids")?.to_string())
}

/// Each row of `k` weights reordered by its row of expert ids.
fn in_id_order(weights: &[f32], ids: &[f32], k: usize) -> Vec<f32> {
    weights
        .chunks(k)
        .zip(ids.chunks(k))
        .flat_map(|(w, i)| {
            let mut pairs: Vec<(f32, f32)> = i.iter().copied().zip(w.iter().copied()).collect();
            pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
            pairs.into_iter().map(|(_, w)| w)
        })
        .collect()
}

/// Compare stage `name` at `rank`; `r` and `c` are the records standing for each side (the
/// whole record, or a rank part when the side only holds parts); `block`: the rank's part of a
/// whole record, where one side holds only the rank's part.
fn measure(
    reference: &Trace,
    candidate: &Trace,
    name: &str,
    rank: Option<u32>,
    (r, c): (&StageRecord, &StageRecord),
    block: Option<&Block>,
) -> Result<Measured> {
    let (rv, cv) = (
        side_values(reference, name, rank, block)?,
        side_values(candidate, name, rank, block)?,
    );
    // A whole record stands for its block: the statistics of the block's values.
    let part_stats = |side: &Option<(Vec<f32>, Vec<u64>)>, rec: &StageRecord| match side {
        Some((v, shape)) if block.is_some() && rec.rank != rank => StageRecord {
            shape: shape.clone(),
            rank,
            stats: TensorStats::of(v),
            ..rec.clone()
        },
        _ => rec.clone(),
    };
    let (r, c) = (&part_stats(&rv, r), &part_stats(&cv, c));
    if let (Some((x, xs)), Some((y, ys))) = (&rv, &cv) {
        if xs == ys {
            let (reference, candidate) = (Side::of_values(x), Side::of_values(y));
            if r.dtype == ElemType::I32 {
                let (a, b) = (id_sets(x, xs), id_sets(y, ys));
                let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
                let rel_diff = differ as f64 / a.len().max(1) as f64;
                let (basis, metrics, shape) = (Basis::Ids, None, xs.clone());
                return Ok(Measured {
                    rel_diff,
                    basis,
                    ids_uncounted: false,
                    metrics,
                    shape,
                    reference,
                    candidate,
                });
            }
            let m = Metrics::of(x, y);
            return Ok(Measured {
                rel_diff: m.rel_diff,
                basis: Basis::Values,
                ids_uncounted: false,
                metrics: Some(m),
                shape: xs.clone(),
                reference,
                candidate,
            });
        }
    }
    // Statistics: equal hashes are equal tensors; otherwise the norms' bound or the sketches'
    // estimate, whichever is larger.
    let same = r.shape == c.shape && r.rank == c.rank;
    let rel_diff = if !same {
        1.0
    } else if r.stats.hash == c.stats.hash {
        0.0
    } else if r.dtype == ElemType::I32 {
        // Ids in another order with every statistic equal: the same choices.
        let multiset = |t: &TensorStats| [t.count as f64, t.mean, t.std, t.min, t.max, t.l2];
        if multiset(&r.stats) == multiset(&c.stats) {
            0.0
        } else {
            1.0
        }
    } else {
        // The norms bound rel_diff from below; the sketches estimate it, and see a permutation
        // or a sign flip that leaves every moment as it was.
        let (a, b) = (r.stats.l2, c.stats.l2);
        let bound = if a * a + b * b > 0.0 {
            (a - b).powi(2) / (a * a + b * b)
        } else {
            0.0
        };
        // A record without a sketch (an older writer, a GPU) gets one from the values held.
        let reference_stats = match (&rv, r.stats.sketch.is_empty()) {
            (Some((x, xs)), true) if *xs == r.shape => TensorStats {
                sketch: sketch(x),
                ..r.stats.clone()
            },
            _ => r.stats.clone(),
        };
        bound.max(reference_stats.sketch_rel_diff(&c.stats).unwrap_or(0.0))
    };
    let ids = r.dtype == ElemType::I32;
    Ok(Measured {
        rel_diff,
        basis: if ids { Basis::Ids } else { Basis::Stats },
        ids_uncounted: ids && same && rel_diff > 0.0,
        metrics: None,
        shape: r.shape.clone(),
        reference: Side::of_stats(&r.stats),
        candidate: Side::of_stats(&c.stats),
    })
}

/// What to compare, in the reference's recording order: each stage whole (rank parts
/// unsharded), then rank by rank where both sides recorded the same ranks. With the records
/// that stand for each side.
fn pairs<'t>(reference: &'t Trace, candidate: &'t Trace) -> Vec<Pair<'t>> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for r in reference.stages() {
        // Top-k boundary gaps explain near ties; they are not outputs to judge.
        if is_gaps(&r.name) || !seen.insert(r.name.as_str()) {
            continue;
        }
        let stands_for = |t: &'t Trace| {
            t.stage(&r.name, None)
                .or_else(|| t.stages().iter().find(|s| s.name == r.name))
        };
        // The whole stage is known from a whole record, or from every rank part's values;
        // a part's statistics alone say nothing of the whole.
        let whole_known = |t: &Trace| {
            t.stage(&r.name, None).is_some()
                || t.stages()
                    .iter()
                    .filter(|s| s.name == r.name)
                    .all(|s| s.file.is_some())
        };
        if let (Some(rw), Some(cw)) = (stands_for(reference), stands_for(candidate)) {
            if whole_known(reference) && whole_known(candidate) {
                out.push((r.name.clone(), None, (rw, cw), None));
            }
        }
        for rr in reference
            .stages()
            .iter()
            .filter(|s| s.name == r.name && s.rank.is_some())
        {
            if let Some(cr) = candidate.stage(&r.name, rr.rank) {
                out.push((r.name.clone(), rr.rank, (rr, cr), None));
            }
        }
        // Rank parts the candidate keeps as statistics only, against the reference's whole
        // stage: each part against its block of the reference.
        let ranked = |t: &'t Trace| -> Vec<&'t StageRecord> {
            let mut parts: Vec<&StageRecord> = t
                .stages()
                .iter()
                .filter(|s| s.name == r.name && s.rank.is_some())
                .collect();
            parts.sort_by_key(|s| s.rank);
            parts
        };
        let (theirs, whole) = (ranked(candidate), reference.stage(&r.name, None));
        if let (Some(rw), false, true) = (whole, theirs.is_empty(), ranked(reference).is_empty()) {
            if whole_known(candidate) {
                continue;
            }
            let shapes: Vec<Vec<u64>> = theirs.iter().map(|s| s.shape.clone()).collect();
            let Ok(sharding) = Sharding::of(&theirs[0].dims) else {
                continue;
            };
            for (i, cr) in theirs.iter().enumerate() {
                if let Some(block) = Block::of_rank(&sharding, &shapes, i) {
                    out.push((r.name.clone(), cr.rank, (rw, *cr), Some(block)));
                }
            }
        }
    }
    out
}

/// One comparison: the stage, the rank (None: whole), the records standing for each side, and
/// the rank's block of the whole where only the candidate holds rank parts.
type Pair<'t> = (
    String,
    Option<u32>,
    (&'t StageRecord, &'t StageRecord),
    Option<Block>,
);

/// Compare `candidate` against `reference`.
pub fn diff(reference: &Trace, candidate: &Trace, opts: &DiffOptions) -> Result<DiffReport> {
    // An engine that computed some stages at some positions only (SGLang's logits) is compared
    // with the reference's same positions.
    let cut_reference = reference.at_rows_of(candidate)?;
    let reference = cut_reference.as_ref().unwrap_or(reference);
    let cut_envelope = match opts.envelope {
        Some(e) => e.at_rows_of(candidate)?,
        None => None,
    };
    let opts = &DiffOptions {
        envelope: cut_envelope.as_ref().or(opts.envelope),
        ..*opts
    };
    let cand_dtype = candidate.manifest().dtype.clone();
    let default = opts
        .tolerance
        .unwrap_or_else(|| default_tolerance(&cand_dtype));
    let lower_precision = !matches!(cand_dtype.as_str(), "f32" | "f64");
    let mut stages = Vec::new();
    let mut prev_rel: Option<f64> = None;
    for (name, rank, (r, c), block) in pairs(reference, candidate) {
        let m = measure(reference, candidate, &name, rank, (r, c), block.as_ref())?;
        let tolerance = match (opts.envelope, opts.tolerance) {
            (Some(env), None) => {
                envelope_tolerance(reference, env, (&name, rank), r, block.as_ref())?
            }
            _ => default,
        };
        let new_non_finite = m.candidate.non_finite() > m.reference.non_finite();
        // At a lower precision, near ties at a top-k boundary may break the other way: another
        // choice is judged by what it does to the stages after it, not by itself. So are ids
        // kept as statistics only, which say that some choice changed but not whether it was
        // a near tie (the stages they feed are compared by their sketches).
        let judged = m.basis != Basis::Ids || !(lower_precision || m.ids_uncounted);
        let status = if judged && m.rel_diff > tolerance || new_non_finite {
            Status::Fail
        } else {
            Status::Pass
        };
        let amplification = match (m.basis, prev_rel) {
            (Basis::Ids, _) | (_, None) => None,
            // An input that matched exactly: the error is made here, by no finite factor.
            (_, Some(p)) if p == 0.0 && m.rel_diff > 0.0 => Some(f64::INFINITY),
            (_, Some(p)) => Some(m.rel_diff / p.max(f64::MIN_POSITIVE)),
        };
        if m.basis != Basis::Ids && rank.is_none() {
            prev_rel = Some(m.rel_diff);
        }
        stages.push(StageDiff {
            layer: layer_of(&name),
            stage: name,
            rank,
            status,
            basis: m.basis,
            rel_diff: m.rel_diff,
            tolerance,
            amplification,
            metrics: m.metrics,
            shape: m.shape,
            reference: m.reference,
            candidate: m.candidate,
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
    let partial = Partial::of(reference, candidate);
    Ok(DiffReport {
        verdict: if first.is_some() || partial.any() {
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
        candidate: candidate.shown().display().to_string(),
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
        partial,
        stages,
    })
}

/// A stage's calibrated tolerance: the envelope's own departure from the reference there, times
/// [`ENVELOPE_FACTOR`], never below [`F32_TOLERANCE`].
fn envelope_tolerance(
    reference: &Trace,
    envelope: &Trace,
    (name, rank): (&str, Option<u32>),
    r: &StageRecord,
    block: Option<&Block>,
) -> Result<f64> {
    let Some(e) = envelope
        .stage(name, rank)
        .or_else(|| envelope.stages().iter().find(|s| s.name == name))
    else {
        return Ok(default_tolerance(&envelope.manifest().dtype));
    };
    let m = measure(reference, envelope, name, rank, (r, e), block)?;
    Ok((ENVELOPE_FACTOR * m.rel_diff).max(rounding_floor(&envelope.manifest().dtype)))
}

/// The finest `rel_diff` a stage at `dtype` is judged by, whatever the envelope: a few
/// roundings to the dtype (8 · u², u its unit roundoff). Engines round in different places (the
/// routing weights, a normalisation), so an envelope that rounds less than the candidate must
/// not turn one more rounding into a fault.
pub fn rounding_floor(dtype: &str) -> f64 {
    let unit = match dtype {
        "bf16" => 2f64.powi(-8),
        "f16" => 2f64.powi(-11),
        _ => return F32_TOLERANCE,
    };
    (8.0 * unit * unit).max(F32_TOLERANCE)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_weights_compare_in_expert_order() {
        // Experts [1, 2] and [2, 1] with the same weights per expert are the same choice.
        let a = in_id_order(&[0.7, 0.3], &[1.0, 2.0], 2);
        let b = in_id_order(&[0.3, 0.7], &[2.0, 1.0], 2);
        assert_eq!(a, b);
        assert_eq!(rounding_floor("bf16"), 8.0 / 65536.0);
        assert_eq!(rounding_floor("f32"), F32_TOLERANCE);
    }
}
