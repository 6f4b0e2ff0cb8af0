//! The transformers probe's tensor-parallel recording (`--tp-plan`), on CPU. transformers' own TP
//! loader needs `accelerate` and is run on the GPU machine only (probes/README.md), so
//! `glmcheck_oracle.hf_probe.tp_ranks` shards the attention heads by hand in two gloo processes
//! the way the plan's colwise / rowwise styles do and has every rank record with the probe. The merged
//! trace holds rank parts of the head-split stages, whole replicated stages that agree across
//! ranks, and passes `bisect --candidate`; shards given to the wrong rank are caught.

use crate::common;

use std::path::Path;

use glmcheck::trace::Trace;

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

fn record(hf: &Path, out: &Path, dtype: &str, extra: &[&str]) {
    let mut args = vec![
        hf.to_str().unwrap(),
        TOKENS,
        out.to_str().unwrap(),
        "2",
        dtype,
    ];
    args.extend(extra);
    common::run_oracle("hf_probe.tp_ranks", &args);
}

#[test]
fn rank_parts_merge_into_a_trace_that_passes_bisect() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    common::synth_tiny(&hf, &["--format", "hf"]);
    for dtype in ["f32", "bf16"] {
        let out = dir.path().join(format!("tp2-{dtype}.trace"));
        record(&hf, &out, dtype, &[]);
        assert!(
            !dir.path().join(format!("tp2-{dtype}.trace.ranks")).exists(),
            "the ranks' own traces are removed after the merge"
        );
        let trace = Trace::open(&out).expect("the merged trace opens");
        let m = trace.manifest();
        assert_eq!(
            (m.backend.as_str(), m.dtype.as_str(), m.tp),
            ("transformers", dtype, 2)
        );
        assert_eq!(m.producer["disagree"], serde_json::json!([]), "{dtype}");
        assert_eq!(m.producer["tp_plan"], "emulated");
        for stage in ["attn.q", "attn.kv", "attn.q_rope", "attn.ctx"] {
            let name = format!("L0.{stage}");
            assert!(trace.stage(&name, None).is_none(), "{name} whole");
            for rank in [0, 1] {
                let s = trace
                    .stage(&name, Some(rank))
                    .unwrap_or_else(|| panic!("{name} rank {rank}"));
                assert_eq!(s.shape[1], 4, "{name}: 4 of 8 heads per rank");
                assert_eq!(s.dims, "t h(tp) d");
            }
        }
        for name in ["L0.attn.out", "L1.moe.routed", "L1.moe.shared", "logits"] {
            assert!(trace.stage(name, None).is_some(), "{name} whole");
            assert!(trace.stage(name, Some(0)).is_none(), "{name} split");
        }
        assert_eq!(trace.stage("L1.moe.routed", None).unwrap().dims, "t d");
        let j = common::bisect_candidate(&hf, &out, &[], 0);
        assert_eq!(j["verdict"], "pass", "{dtype}: {:#}", j["fault"]);
    }
}

#[test]
fn shards_on_the_wrong_rank_are_caught() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    common::synth_tiny(&hf, &["--format", "hf"]);
    let out = dir.path().join("swapped.trace");
    record(&hf, &out, "f32", &["swap-q-shards"]);
    let j = common::bisect_candidate(&hf, &out, &[], 1);
    assert_eq!(j["first_divergence"]["stage"], "L0.attn.q");
    assert_eq!(
        j["fault"]["class"], "wrong_shard_layout",
        "{:#}",
        j["fault"]
    );
    // Every rank's kv_b cut one head late: each head is one of the reference's, at the wrong
    // offset, which the rank parts show head by head.
    let out = dir.path().join("shifted.trace");
    record(&hf, &out, "f32", &["shift-kv-heads"]);
    let j = common::bisect_candidate(&hf, &out, &[], 1);
    assert_eq!(j["first_divergence"]["stage"], "L0.attn.kv");
    assert_eq!(
        j["fault"]["class"], "wrong_shard_layout",
        "{:#}",
        j["fault"]
    );
    let evidence = j["fault"]["evidence"].to_string();
    assert!(
        evidence.contains("rank 0 holds slices [1, 2, 3, 4] where the plan gives 0..4"),
        "{evidence}"
    );
}
