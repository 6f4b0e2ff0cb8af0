//! `glmcheck diff` on traces of several tensor-parallel ranks, made from the reference executor's
//! run (`diff_classify`): ranks that disagree on a reduced output (a missing all-reduce) or sit
//! a rounding apart (none), and per-rank parts unsharded by their dims and compared rank by rank,
//! ranks in the wrong order named so.

use crate::common;
use crate::diff_classify::{header_like, perturbed_as, reference_runs, Perturbation};

use std::path::Path;

use glmcheck::compare::{diff, DiffOptions, FaultClass, Status};
use glmcheck::trace::{ElemType, FullSelector, Stage, Trace, TraceWriter};

/// A replicated stage whose ranks held other values than rank 0's (a merged engine trace's
/// `producer.disagree`) at a reduced output: the reduction was left out.
#[test]
fn ranks_disagreeing_on_a_reduced_output_are_a_missing_all_reduce() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32"]);
    let reference = Trace::open(&runs[0]).unwrap();
    let out = dir.path().join("unreduced.trace");
    let disagree = serde_json::json!({"disagree": [
        {"stage": "L1.attn.out", "rank": 1},
        {"stage": "L1.attn.out", "rank": 3}
    ]});
    let cand = perturbed_as(
        &reference,
        "L1.attn.out",
        Perturbation::Noise,
        &out,
        &["**"],
        Some(disagree),
    );
    let report = diff(&reference, &cand, &DiffOptions::default()).unwrap();
    assert_eq!(report.first_divergence.unwrap().stage, "L1.attn.out");
    let f = report.fault.unwrap();
    assert_eq!(f.class, FaultClass::MissingAllReduce, "{f:#?}");
    assert!(f.evidence[0].contains("rank 1, 3"), "{f:#?}");
}

/// `producer.disagree` entries carrying each rank's statistics (vLLM's probe writes them): a rank
/// a rounding away from rank 0 (an all-reduce summed in another order) is no evidence, a rank as
/// far from it as the reference (a partial sum) is.
#[test]
fn ranks_a_rounding_apart_are_not_a_missing_all_reduce() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32"]);
    let reference = Trace::open(&runs[0]).unwrap();
    let stage = "L1.attn.out";
    let first = perturbed_as(
        &reference,
        stage,
        Perturbation::Noise,
        &dir.path().join("first.trace"),
        &["**"],
        None,
    );
    let stats = |t: &Trace| serde_json::to_value(&t.stage(stage, None).unwrap().stats).unwrap();
    let (rank0, reference_copy) = (stats(&first), stats(&reference));
    let case = |name: &str, disagree: serde_json::Value| {
        let cand = perturbed_as(
            &reference,
            stage,
            Perturbation::Noise,
            &dir.path().join(name),
            &["**"],
            Some(serde_json::json!({ "disagree": disagree })),
        );
        let report = diff(&reference, &cand, &DiffOptions::default()).unwrap();
        assert_eq!(report.first_divergence.unwrap().stage, stage);
        report.fault.unwrap()
    };
    let f = case(
        "rounding.trace",
        serde_json::json!([{"stage": stage, "rank": 1, "stats": rank0}]),
    );
    assert_ne!(f.class, FaultClass::MissingAllReduce, "{f:#?}");
    let f = case(
        "partial.trace",
        serde_json::json!([
            {"stage": stage, "rank": 1, "stats": rank0},
            {"stage": stage, "rank": 3, "stats": reference_copy}
        ]),
    );
    assert_eq!(f.class, FaultClass::MissingAllReduce, "{f:#?}");
    assert!(f.evidence[0].contains("yet rank 3 held"), "{f:#?}");
}

/// `reference` as a TP = 2 run would record it: `(tp)` axes split in two, `partial(tp)`
/// stages as two addends, the rest whole; with `swap`'s two ranks exchanged.
fn as_two_ranks(reference: &Trace, out: &Path, swap: Option<&str>) -> Trace {
    use glmcheck::compare::unshard::Sharding;
    let header = header_like(reference, "tp2", 2);
    let mut w = TraceWriter::create(out, header, FullSelector::new(&["**"]).unwrap()).unwrap();
    for s in reference.stages() {
        if s.dtype == ElemType::I32 {
            let ids = reference.tensor_i32(&s.name, None).unwrap().unwrap();
            w.record(&s.name, &s.shape, &s.dims, None, Stage::I32(&ids))
                .unwrap();
            continue;
        }
        let v = reference.tensor(&s.name, None).unwrap().unwrap();
        let mut parts: Vec<(Vec<u64>, Vec<f32>)> = match Sharding::of(&s.dims).unwrap() {
            Sharding::Split(axis) if s.shape[axis] % 2 == 0 => {
                let inner: u64 = s.shape[axis + 1..].iter().product();
                let block = (s.shape[axis] / 2 * inner) as usize;
                let mut shape = s.shape.clone();
                shape[axis] /= 2;
                let half = |r: usize| -> Vec<f32> {
                    v.chunks(2 * block)
                        .flat_map(|c| c[r * block..(r + 1) * block].to_vec())
                        .collect()
                };
                vec![(shape.clone(), half(0)), (shape, half(1))]
            }
            Sharding::Partial => vec![
                (s.shape.clone(), v.iter().map(|x| x * 0.25).collect()),
                (s.shape.clone(), v.iter().map(|x| x - x * 0.25).collect()),
            ],
            _ => {
                w.record(&s.name, &s.shape, &s.dims, None, Stage::F32(&v))
                    .unwrap();
                continue;
            }
        };
        if swap == Some(s.name.as_str()) {
            parts.swap(0, 1);
        }
        for (rank, (shape, part)) in parts.iter().enumerate() {
            w.record(&s.name, shape, &s.dims, Some(rank as u32), Stage::F32(part))
                .unwrap();
        }
    }
    w.finish().unwrap();
    Trace::open(out).unwrap()
}

/// Per-rank stages are unsharded by their dims spec (heads and vocabulary concatenated, partial
/// sums added) and compared whole and rank by rank; ranks in the wrong order are named so.
#[test]
fn tensor_parallel_parts_are_unsharded_and_compared_by_rank() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32"]);
    let reference = Trace::open(&runs[0]).unwrap();
    let tp2 = as_two_ranks(&reference, &dir.path().join("tp2.trace"), None);
    assert!(
        tp2.stages().iter().any(|s| s.rank == Some(1)),
        "ranks recorded"
    );
    let whole = diff(&reference, &tp2, &DiffOptions::default()).unwrap();
    assert_eq!(whole.verdict, Status::Pass, "{:?}", whole.first_divergence);
    let q = whole
        .stages
        .iter()
        .find(|s| s.stage == "L1.attn.q" && s.rank.is_none())
        .unwrap();
    assert_eq!(
        (q.rel_diff, q.basis),
        (0.0, glmcheck::compare::stage_diff::Basis::Values)
    );
    let by_rank = diff(&tp2, &tp2, &DiffOptions::default()).unwrap();
    assert!(by_rank
        .stages
        .iter()
        .any(|s| s.stage == "L1.attn.q" && s.rank == Some(1)));
    assert_eq!(by_rank.verdict, Status::Pass);

    let swapped = as_two_ranks(
        &reference,
        &dir.path().join("swap.trace"),
        Some("L1.attn.q"),
    );
    let report = diff(&tp2, &swapped, &DiffOptions::default()).unwrap();
    let first = report.first_divergence.expect("ranks out of order");
    assert_eq!((first.stage.as_str(), first.rank), ("L1.attn.q", None));
    // Each rank's part is the other's block of the reference: shards in the wrong rank order.
    let fault = report.fault.unwrap();
    assert_eq!(fault.class, FaultClass::WrongShardLayout);
    assert!(
        fault.evidence[0].contains("rank 0 holds block 1, rank 1 holds block 0"),
        "{:?}",
        fault.evidence
    );
    let rank0 = report
        .stages
        .iter()
        .find(|s| s.stage == "L1.attn.q" && s.rank == Some(0));
    assert_eq!(
        rank0.unwrap().status,
        Status::Fail,
        "rank 0 holds rank 1's heads"
    );
}
