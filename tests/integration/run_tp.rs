//! `glmcheck run --tp N`: vLLM's tensor-parallel split run on the CPU rank by rank — whole heads
//! of q_b/kv_b per rank, RowParallel o_proj and down projections all-reduced, experts split
//! along their intermediate dimension — equals TP 1 up to summation order (checked with
//! `glmcheck diff` at the f32 tolerance, and at bf16), generates the same tokens, and records
//! each rank's part of the split stages (vocab-parallel embedding and lm_head included) beside
//! the whole after each all-reduce.

use crate::common;

use std::process::Command;

use glmcheck::compare::{diff, DiffOptions, Status};
use glmcheck::trace::Trace;

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

fn run(model: &str, tp: u32, dtype: &str, out: &std::path::Path) -> serde_json::Value {
    let tp = tp.to_string();
    common::glmcheck_json(
        [
            "run",
            model,
            "--tokens",
            TOKENS,
            "--full",
            "**",
            "--tp",
            &tp,
            "--dtype",
            dtype,
            "--generate",
            "8",
            "--json",
            "--out",
            out.to_str().unwrap(),
        ],
        0,
    )
}

#[test]
fn tensor_parallel_runs_equal_one_rank() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    // 8 heads so that TP 8 splits them; 16 indexer heads: no exact DSA ties.
    common::glmcheck_json(
        [
            "synth",
            "--format",
            "hf",
            "--set",
            "index_n_heads=16",
            "--set",
            "num_attention_heads=8",
            "--json",
            "--out",
            hf.to_str().unwrap(),
        ],
        0,
    );
    let model = hf.to_str().unwrap();
    for dtype in ["f32", "bf16"] {
        let one = dir.path().join(format!("{dtype}-tp1.trace"));
        let reference_run = run(model, 1, dtype, &one);
        let reference = Trace::open(&one).unwrap();
        for tp in [2u32, 4, 8] {
            let out = dir.path().join(format!("{dtype}-tp{tp}.trace"));
            let ran = run(model, tp, dtype, &out);
            assert_eq!(
                ran["generated"], reference_run["generated"],
                "{dtype} TP {tp}"
            );
            let trace = Trace::open(&out).unwrap();
            assert_eq!(trace.manifest().tp, tp);
            for stage in [
                "embed",
                "L0.attn.q",
                "L0.attn.kv",
                "L0.attn.ctx",
                "L0.attn.out",
                "L1.moe.routed",
                "L1.moe.shared",
                "logits",
            ] {
                let ranks: Vec<Option<u32>> = trace
                    .stages()
                    .iter()
                    .filter(|s| s.name == stage && s.rank.is_some())
                    .map(|s| s.rank)
                    .collect();
                assert_eq!(
                    ranks,
                    (0..tp).map(Some).collect::<Vec<_>>(),
                    "{stage} per rank"
                );
            }
            // The stages after an all-reduce or gather are also recorded whole.
            for stage in ["embed", "L0.attn.out", "logits"] {
                assert!(trace.stage(stage, None).is_some(), "{stage} whole");
            }
            assert_eq!(trace.stage("logits", Some(0)).unwrap().dims, "t v(tp)");
            let q = trace.stage("L0.attn.q", Some(tp - 1)).unwrap();
            assert_eq!(q.shape[1], 8 / u64::from(tp), "whole heads per rank");
            let out_dims = &trace.stage("L0.attn.out", Some(0)).unwrap().dims;
            assert_eq!(out_dims, "t d partial(tp)");
            // Summation-order noise: the f32 default tolerance, or bf16's (partial sums are
            // rounded to bf16 before the all-reduce, as engines do).
            let report = diff(&reference, &trace, &DiffOptions::default()).unwrap();
            assert_eq!(
                report.verdict,
                Status::Pass,
                "{dtype} TP {tp}: {:?}",
                report.first_divergence
            );
        }
    }
    let bad = Command::new(common::glmcheck_bin())
        .args(["run", model, "--tokens", TOKENS, "--tp", "3", "--out"])
        .arg(dir.path().join("bad.trace"))
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("num_attention_heads = 8"));
    assert!(
        !dir.path().join("bad.trace").exists(),
        "no trace left behind"
    );
}

/// `run --warm-up N` runs N unrecorded forward passes first (on the GPUs they leave the weights
/// resident); the recorded pass is the same run, stage for stage.
#[test]
fn warm_up_passes_leave_the_recorded_run_unchanged() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    common::synth_tiny(&model, &["--quant", "q4_k_m"]);
    let traces: Vec<Trace> = ["0", "2"]
        .iter()
        .map(|warm_up| {
            let out = dir.path().join(format!("warm-{warm_up}.trace"));
            common::glmcheck_ok(&[
                "run",
                model.to_str().unwrap(),
                "--tokens",
                TOKENS,
                "--tp",
                "2",
                "--dtype",
                "bf16",
                "--warm-up",
                warm_up,
                "--out",
                out.to_str().unwrap(),
            ]);
            Trace::open(&out).unwrap()
        })
        .collect();
    let hashes = |t: &Trace| -> Vec<(String, Option<u32>, u64)> {
        t.stages()
            .iter()
            .map(|s| (s.name.clone(), s.rank, s.stats.hash))
            .collect()
    };
    assert!(traces[0].stages().len() > 50);
    assert_eq!(hashes(&traces[0]), hashes(&traces[1]));
}
