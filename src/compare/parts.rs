//! What a candidate's per-rank parts say about a divergence: partial sums that add up to the
//! reference while the all-reduced stage does not (a collective left out or run twice), and
//! head blocks that are the reference's blocks of other ranks (unsharded or reordered shards).

use anyhow::Result;

use super::fault::{Fault, FaultClass};
use super::metrics::Metrics;
use super::stage_diff::{whole_values, StageDiff};
use super::unshard::{same_off_axis, Sharding};
use crate::model::stage::Stage;
use crate::trace::stats::TensorStats;
use crate::trace::Trace;

/// Two tensors this close (`rel_diff`) are the same data at some precision; different data
/// is near 1.
const SAME: f64 = 1e-2;

fn rel(a: &[f32], b: &[f32]) -> f64 {
    if a.len() == b.len() {
        Metrics::of(a, b).rel_diff
    } else {
        f64::INFINITY
    }
}

/// A stage's rank parts in rank order: their values, their shapes and the dims spec.
struct Parts {
    values: Vec<Vec<f32>>,
    shapes: Vec<Vec<u64>>,
    dims: String,
}

/// The candidate's rank parts of `name`.
fn parts(candidate: &Trace, name: &str) -> Result<Option<Parts>> {
    let mut records: Vec<_> = candidate
        .stages()
        .iter()
        .filter(|s| s.name == name && s.rank.is_some())
        .collect();
    if records.len() < 2 {
        return Ok(None);
    }
    records.sort_by_key(|s| s.rank);
    let mut values = Vec::new();
    for r in &records {
        match candidate.tensor(name, r.rank)? {
            Some(v) => values.push(v),
            None => return Ok(None),
        }
    }
    Ok(Some(Parts {
        values,
        shapes: records.iter().map(|r| r.shape.clone()).collect(),
        dims: records[0].dims.clone(),
    }))
}

fn fault(class: FaultClass, summary: String, evidence: Vec<String>) -> Option<Fault> {
    Some(Fault {
        class,
        summary,
        evidence,
        weight: None,
    })
}

/// The ranks on which the candidate's replicated stage `s` held other values than rank 0's by
/// enough to explain its divergence (`producer.disagree` of a merged engine trace:
/// `[{"stage", "rank", "stats"?}]`). An entry with the rank's statistics counts only where they
/// depart from rank 0's by at least a tenth of the stage's divergence from the reference: an
/// all-reduce that sums in another order on each rank (vLLM's CPU communicator at TP 4) leaves
/// the ranks a rounding apart, a missing one a partial sum apart.
fn disagreeing_ranks(candidate: &Trace, s: &StageDiff) -> Vec<u64> {
    let Some(list) = candidate.manifest().producer.get("disagree") else {
        return Vec::new();
    };
    let rank0 = candidate
        .manifest()
        .stages
        .iter()
        .find(|r| r.name == s.stage && r.rank.is_none())
        .map(|r| &r.stats);
    let mut ranks: Vec<u64> = list
        .as_array()
        .into_iter()
        .flatten()
        .filter(|d| d.get("stage").and_then(|v| v.as_str()) == Some(s.stage.as_str()))
        .filter(|d| {
            let other = d
                .get("stats")
                .and_then(|v| serde_json::from_value::<TensorStats>(v.clone()).ok());
            match (rank0, other) {
                (Some(a), Some(b)) => rank_spread(a, &b) >= s.rel_diff / 10.0,
                _ => true,
            }
        })
        .filter_map(|d| d.get("rank").and_then(|r| r.as_u64()))
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// How far another rank's copy of a stage lies from rank 0's, relative to rank 0's size: the
/// distance of their sketches (random projections, whose distance estimates that of the
/// values) where both have one, else of their Euclidean norms.
fn rank_spread(rank0: &TensorStats, other: &TensorStats) -> f64 {
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let (apart, size) = if !rank0.sketch.is_empty() && rank0.sketch.len() == other.sketch.len() {
        let diff: Vec<f64> = rank0
            .sketch
            .iter()
            .zip(&other.sketch)
            .map(|(a, b)| a - b)
            .collect();
        (norm(&diff), norm(&rank0.sketch))
    } else {
        ((rank0.l2 - other.l2).abs(), rank0.l2)
    };
    if size > 0.0 {
        apart / size
    } else if apart > 0.0 {
        f64::INFINITY
    } else {
        0.0
    }
}

/// A replicated stage whose ranks disagree (the merged trace's `producer.disagree`): where it is
/// the output of a tensor-parallel reduction (o_proj's, the experts'), each rank went on with
/// its own partial sum — the reduction was left out there.
pub fn from_disagreement(candidate: &Trace, s: &StageDiff) -> Option<Fault> {
    let ranks = disagreeing_ranks(candidate, s);
    if ranks.is_empty() || s.rank.is_some() {
        return None;
    }
    let stage = Stage::parse(&s.stage)?;
    let folded = folded_reduction(candidate, &stage);
    let reduced = folded.is_some()
        || matches!(
            stage.kind(),
            "attn.out" | "moe.routed" | "moe.shared" | "ffn.out"
        );
    let listed = ranks
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    let mut evidence = vec![
        format!(
            "{}: replicated (every rank should hold the same values), yet rank {listed} held \
             other values than rank 0 (the merged trace's producer.disagree)",
            s.stage
        ),
        format!(
            "{}: rank 0's values depart from the reference by rel_diff {:.3e}",
            s.stage, s.rel_diff
        ),
    ];
    if let Some(input) = folded {
        evidence.push(format!(
            "{input} is recorded as the ranks' partial sums: the engine all-reduces them in the \
             step that makes {} (a fused all-reduce, residual add and norm)",
            s.stage
        ));
    }
    let (class, summary) = match reduced {
        true => (
            FaultClass::MissingAllReduce,
            format!("{}: the ranks hold different values of a reduced output: each went on with its own partial sum", s.stage),
        ),
        false => (
            FaultClass::Unknown,
            format!("{}: the ranks hold different values of a replicated stage", s.stage),
        ),
    };
    fault(class, summary, evidence)
}

/// The residual stream's stage that an engine makes by all-reducing the stage before it, when
/// that stage is recorded as rank partial sums (vLLM's CUDA tree leaves o_proj's and the MLP's
/// outputs un-reduced and folds the all-reduce into the next RMSNorm): that input's name.
fn folded_reduction(candidate: &Trace, stage: &Stage) -> Option<String> {
    let input = match stage.kind() {
        "attn_resid" => "attn.out",
        "out" => "ffn.out",
        _ => return None,
    };
    let name = stage.sibling(input)?.to_string();
    let partial = candidate.stages().iter().any(|r| {
        r.name == name && r.rank.is_some() && matches!(Sharding::of(&r.dims), Ok(Sharding::Partial))
    });
    partial.then_some(name)
}

/// A fault the rank parts of the divergent stage `s` show, if any.
pub fn from_parts(reference: &Trace, candidate: &Trace, s: &StageDiff) -> Result<Option<Fault>> {
    if s.rank.is_some() {
        return Ok(None);
    }
    let at = &s.stage;
    let (Some(p), Some((want, _))) = (parts(candidate, at)?, whole_values(reference, at)?) else {
        return Ok(None);
    };
    Ok(match Sharding::of(&p.dims)? {
        Sharding::Partial => collective(candidate, at, &p.values, &want)?,
        Sharding::Split(axis) => shards(at, &p.values, &p.shapes, axis, &want),
        Sharding::Replicated => None,
    })
}

/// The stage after an all-reduce against the sum of the ranks' partials.
fn collective(
    candidate: &Trace,
    at: &str,
    parts: &[Vec<f32>],
    want: &[f32],
) -> Result<Option<Fault>> {
    if candidate.stage(at, None).is_none() {
        return Ok(None);
    }
    let Some(whole) = candidate.tensor(at, None)? else {
        return Ok(None);
    };
    let mut sum = vec![0f32; want.len()];
    for p in parts.iter().filter(|p| p.len() == want.len()) {
        sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    let partials_right = rel(&sum, want);
    if partials_right > SAME {
        return Ok(None);
    }
    let tp = parts.len();
    let head = format!(
        "the {tp} ranks' partial sums add up to the reference (rel_diff {partials_right:.2e})"
    );
    if let Some(r) = (0..tp).find(|&r| rel(&whole, &parts[r]) <= SAME) {
        return Ok(fault(
            FaultClass::MissingAllReduce,
            format!("{at} is rank {r}'s partial sum: the all-reduce is missing"),
            vec![
                head,
                format!(
                    "{at} after the all-reduce equals rank {r}'s partial alone (rel_diff {:.2e})",
                    rel(&whole, &parts[r])
                ),
            ],
        ));
    }
    let times_tp: Vec<f32> = sum.iter().map(|v| v * tp as f32).collect();
    if rel(&whole, &times_tp) <= SAME {
        return Ok(fault(
            FaultClass::ExtraAllReduce,
            format!("{at} is {tp} × the sum of the partials: reduced twice"),
            vec![
                head,
                format!(
                    "{at} equals {tp} × that sum (rel_diff {:.2e}): the reduced value was \
                     summed over the ranks again",
                    rel(&whole, &times_tp)
                ),
            ],
        ));
    }
    Ok(None)
}

/// The reference's whole tensor cut into the candidate's blocks along `axis`.
fn blocks(want: &[f32], shapes: &[Vec<u64>], axis: usize) -> Option<Vec<Vec<f32>>> {
    let first = shapes.first()?;
    // A trace's parts may disagree off the split axis, or overflow: then there is nothing to cut.
    if !same_off_axis(shapes, axis) {
        return None;
    }
    let product = |dims: &[u64]| dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
    let outer = product(first.get(..axis)?)?;
    let inner = product(first.get(axis + 1..)?)?;
    let along = shapes
        .iter()
        .try_fold(0u64, |n, s| n.checked_add(s[axis]))?;
    let total = along.checked_mul(outer)?.checked_mul(inner)?;
    if total != want.len() as u64 {
        return None;
    }
    let mut out = vec![Vec::new(); shapes.len()];
    let mut at = 0usize;
    for _ in 0..outer {
        for (b, s) in out.iter_mut().zip(shapes) {
            let n = (s[axis] * inner) as usize;
            b.extend_from_slice(&want[at..at + n]);
            at += n;
        }
    }
    Some(out)
}

/// Rank parts of a split stage that are the reference's blocks of other ranks.
fn shards(
    at: &str,
    parts: &[Vec<f32>],
    shapes: &[Vec<u64>],
    axis: usize,
    want: &[f32],
) -> Option<Fault> {
    let expected = blocks(want, shapes, axis)?;
    // For each rank, the reference block it holds, if any.
    let held: Vec<Option<usize>> = parts.iter().map(|p| same_as(p, &expected)).collect();
    let tp = parts.len();
    if held.iter().all(|h| *h == Some(0)) {
        return fault(
            FaultClass::UnshardedWeight,
            format!("{at}: every rank computes rank 0's block"),
            vec![format!(
                "ranks 1..{} hold the reference's block 0 of {tp} along axis {axis}, not their \
                 own: the weight behind it is whole on every rank and each uses its first rows",
                tp - 1
            )],
        );
    }
    let moved: Vec<String> = held
        .iter()
        .enumerate()
        .filter_map(|(r, h)| {
            h.filter(|&b| b != r)
                .map(|b| format!("rank {r} holds block {b}"))
        })
        .collect();
    if held.iter().all(Option::is_some) && !moved.is_empty() {
        return fault(
            FaultClass::WrongShardLayout,
            format!("{at}: the ranks hold each other's blocks"),
            vec![format!(
                "{} (of {tp} along axis {axis}): shards in the wrong rank order",
                moved.join(", ")
            )],
        );
    }
    moved_slices(at, parts, shapes, axis, want)
}

/// The first of `candidates` that `values` equals up to [`SAME`].
fn same_as(values: &[f32], candidates: &[Vec<f32>]) -> Option<usize> {
    candidates.iter().position(|c| rel(values, c) <= SAME)
}

/// `values` of `shape` cut into its slices along `axis` (its heads, for `t h d`).
fn slices(values: &[f32], shape: &[u64], axis: usize) -> Option<Vec<Vec<f32>>> {
    let n = *shape.get(axis)?;
    let mut unit = shape.to_vec();
    unit[axis] = 1;
    // A hostile trace may claim any count: no more slices than values.
    if n > values.len() as u64 {
        return None;
    }
    blocks(values, &vec![unit; n as usize], axis)
}

/// Rank parts whose slices along the split axis (heads) are all the reference's, but not the
/// ones the plan gives them: shards cut at the wrong offset or with their heads reordered.
fn moved_slices(
    at: &str,
    parts: &[Vec<f32>],
    shapes: &[Vec<u64>],
    axis: usize,
    want: &[f32],
) -> Option<Fault> {
    let mut whole_shape = shapes.first()?.clone();
    *whole_shape.get_mut(axis)? = shapes
        .iter()
        .map(|s| s.get(axis).copied().unwrap_or(0))
        .sum();
    let reference = slices(want, &whole_shape, axis)?;
    let mut planned = 0usize;
    let mut moved = Vec::new();
    for (r, (part, shape)) in parts.iter().zip(shapes).enumerate() {
        let held: Vec<usize> = slices(part, shape, axis)?
            .iter()
            .map(|h| same_as(h, &reference))
            .collect::<Option<_>>()?;
        let own: Vec<usize> = (planned..planned + held.len()).collect();
        if held != own {
            moved.push(format!(
                "rank {r} holds slices {:?} where the plan gives {}..{}",
                held,
                own.first()?,
                own.last()? + 1
            ));
        }
        planned += held.len();
    }
    if moved.is_empty() {
        return None;
    }
    fault(
        FaultClass::WrongShardLayout,
        format!("{at}: slices along axis {axis} sit at other ranks or offsets"),
        vec![format!(
            "every slice along axis {axis} (a head, for `t h d`) is one of the reference's, \
             but {}: the weight was split at the wrong offset or its heads reordered",
            moved.join("; ")
        )],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_shifted_inside_a_rank_are_a_wrong_layout() {
        // [1 token, 4 heads, 2]: rank 0 holds heads 0, 1; rank 1 should hold 2, 3 but holds 3, 2.
        let want = [0., 1., 10., 11., 20., 21., 30., 31.];
        let shapes = vec![vec![1, 2, 2], vec![1, 2, 2]];
        let parts = vec![vec![0., 1., 10., 11.], vec![30., 31., 20., 21.]];
        let f = shards("L0.attn.kv", &parts, &shapes, 1, &want).unwrap();
        assert_eq!(f.class, FaultClass::WrongShardLayout);
        assert!(
            f.evidence[0].contains(
                "is one of the reference's, but rank 1 holds slices [3, 2] where the plan gives 2..4"
            ),
            "{:?}",
            f.evidence
        );
        // The planned layout, or a head that is no head of the reference: no layout fault.
        let right = vec![vec![0., 1., 10., 11.], vec![20., 21., 30., 31.]];
        assert!(shards("L0.attn.kv", &right, &shapes, 1, &want).is_none());
        let other = vec![vec![0., 1., 10., 11.], vec![5., 5., 20., 21.]];
        assert!(shards("L0.attn.kv", &other, &shapes, 1, &want).is_none());
    }

    #[test]
    fn blocks_undo_a_split_along_the_middle_axis() {
        // [2 tokens, 2 heads, 1]: token-major; rank blocks hold one head each.
        let want = [1., 2., 3., 4.];
        let shapes = vec![vec![2, 1, 1], vec![2, 1, 1]];
        assert_eq!(
            blocks(&want, &shapes, 1).unwrap(),
            vec![vec![1., 3.], vec![2., 4.]]
        );
        // Parts of another rank, or sizes past 64 bits, from a hostile trace: no blocks.
        assert_eq!(blocks(&want, &[vec![2, 1, 1], vec![2]], 1), None);
        assert_eq!(
            blocks(&want, &[vec![u64::MAX, 2, 2], vec![u64::MAX, 2, 2]], 1),
            None
        );
    }
}
