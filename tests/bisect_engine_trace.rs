//! `glmcheck bisect MODEL --candidate TRACE`: an engine's trace as the candidate. The
//! transformers probe's traces of the model (f32, and bf16 judged against the reference re-run
//! at the trace's dtype) pass; traces with a planted fault are diagnosed from what they hold
//! (rank parts, inputs that agree).

mod common;

use std::path::Path;
use std::process::Command;

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

fn synth_hf(out: &Path) {
    common::synth_tiny(out, &["--format", "hf"]);
}

fn probe(hf: &Path, dtype: &str, out: &Path) {
    let run = Command::new(common::python())
        .env("PYTHONPATH", common::root().join("probes"))
        .args(["-m", "glmcheck_probe.transformers_probe"])
        .arg(hf)
        .args([
            "--tokens", TOKENS, "--dtype", dtype, "--full", "**", "--out",
        ])
        .arg(out)
        .output()
        .expect("start python");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

fn bisect(hf: &Path, trace: &Path, code: i32) -> serde_json::Value {
    common::glmcheck_json(
        [
            "bisect",
            hf.to_str().unwrap(),
            "--candidate",
            trace.to_str().unwrap(),
            "--json",
        ],
        code,
    )
}

#[test]
fn the_transformers_probe_passes_at_f32_and_bf16() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    synth_hf(&hf);
    for dtype in ["f32", "bf16"] {
        let trace = dir.path().join(format!("{dtype}.trace"));
        probe(&hf, dtype, &trace);
        let j = bisect(&hf, &trace, 0);
        assert_eq!(j["verdict"], "pass", "{dtype}: {:#}", j["fault"]);
        assert_eq!(j["bisect"]["dtype"], dtype);
        // The prompt is the trace's.
        assert_eq!(j["bisect"]["prompt"], serde_json::Value::Null);
        assert_eq!(j["bisect"]["envelope"].is_string(), dtype == "bf16");
    }
}

#[test]
fn faulty_traces_are_diagnosed_from_what_they_hold() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    synth_hf(&hf);
    let cases = [
        ("unsharded-column", "2", "L0.attn.kv", "unsharded_weight"),
        ("rank-order=q_b", "4", "L0.attn.q", "wrong_shard_layout"),
        ("skip-all-reduce", "2", "L0.attn.out", "missing_all_reduce"),
        ("double-all-reduce", "4", "L0.attn.out", "extra_all_reduce"),
        ("rope-neox", "1", "L0.attn.q_rope", "rope_mismatch"),
        ("router-softmax", "1", "L1.moe.topk_ids", "router_mismatch"),
        ("flat-lm-head", "1", "logits", "flat_logits"),
    ];
    for (fault, tp, stage, class) in cases {
        let trace = dir.path().join(format!("{fault}.trace"));
        common::glmcheck_json(
            [
                "run",
                hf.to_str().unwrap(),
                "--tokens",
                TOKENS,
                "--tp",
                tp,
                "--inject",
                fault,
                "--full",
                "**",
                "--json",
                "--out",
                trace.to_str().unwrap(),
            ],
            0,
        );
        let j = bisect(&hf, &trace, 1);
        assert_eq!(j["first_divergence"]["stage"], stage, "{fault}");
        assert_eq!(j["fault"]["class"], class, "{fault}: {:#}", j["fault"]);
        assert_eq!(j["bisect"]["classified_by"], "traces", "{fault}");
    }
    // A fault is planted in a run glmcheck makes, not in an engine's trace.
    let out = Command::new(common::glmcheck_bin())
        .args(["bisect", hf.to_str().unwrap(), "--candidate"])
        .arg(dir.path().join("rope-neox.trace"))
        .args(["--inject", "rope-neox"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
