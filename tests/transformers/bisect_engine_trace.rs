//! `glmcheck bisect MODEL --candidate TRACE`: an engine's trace as the candidate. The
//! transformers probe's traces of the model (f32, and bf16 judged against the reference re-run
//! at the trace's dtype) pass; traces with a planted fault are diagnosed from what they hold
//! (rank parts, inputs that agree), and so are the probe's traces of a transformers model with
//! one module broken (NeoX RoPE patched in, the router's correction bias dropped).

use crate::common;

use std::path::Path;
use std::process::Command;

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

fn synth_hf(out: &Path) {
    common::synth_tiny(out, &["--format", "hf"]);
}

fn probe(hf: &Path, dtype: &str, out: &Path) {
    let run = Command::new(common::python())
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

/// A trace standing for an engine's: glmcheck's run at `tp` with `fault` planted, every stage
/// in full.
fn engine_run(hf: &Path, tp: &str, fault: &str, out: &Path) {
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
            out.to_str().unwrap(),
        ],
        0,
    );
}

#[test]
fn the_transformers_probe_passes_at_f32_and_bf16() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    synth_hf(&hf);
    for dtype in ["f32", "bf16"] {
        let trace = dir.path().join(format!("{dtype}.trace"));
        probe(&hf, dtype, &trace);
        let j = common::bisect_candidate(&hf, &trace, &[], 0);
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
        engine_run(&hf, tp, fault, &trace);
        let j = common::bisect_candidate(&hf, &trace, &[], 1);
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

/// The status of stage `name` in a bisect's JSON.
fn status<'j>(j: &'j serde_json::Value, name: &str) -> &'j serde_json::Value {
    let stages = j["stages"].as_array().unwrap();
    let s = stages.iter().find(|s| s["stage"] == name);
    &s.unwrap_or_else(|| panic!("{name} not compared"))["status"]
}

/// transformers itself broken the way an engine breaks (`glmcheck_oracle.hf_probe.broken`
/// patches the loaded model in its own process), recorded by the probe: bisect names the first
/// stage the break reaches and its class, from the trace alone.
#[test]
fn broken_transformers_modules_recorded_by_the_probe_are_diagnosed() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    synth_hf(&hf);
    for (break_, stage, class, agrees) in [
        ("rope-neox", "L0.attn.q_rope", "rope_mismatch", "L0.attn.q"),
        (
            "router-no-bias",
            "L1.moe.topk_ids",
            "router_mismatch",
            "L1.moe.router_logits",
        ),
    ] {
        let trace = dir.path().join(format!("{break_}.trace"));
        let run = common::oracle_command(&common::python(), "hf_probe.broken")
            .arg(break_)
            .arg(&hf)
            .args(["--tokens", TOKENS, "--full", "**", "--out"])
            .arg(&trace)
            .output()
            .expect("start python");
        assert!(
            run.status.success(),
            "{break_}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let j = common::bisect_candidate(&hf, &trace, &[], 1);
        assert_eq!(j["first_divergence"]["stage"], stage, "{break_}");
        assert_eq!(j["fault"]["class"], class, "{break_}: {:#}", j["fault"]);
        assert_eq!(j["bisect"]["classified_by"], "traces", "{break_}");
        // The stage the break reads from still agrees: the break is where bisect says.
        assert_eq!(status(&j, agrees), "pass", "{break_}: {agrees}");
    }
}

/// The seed story from an engine's side: its trace diverges at `L0.attn.kv`, and its shard
/// manifest (every rank holding rank 0's block of kv_b_proj) names the cause.
#[test]
fn an_engine_trace_with_its_shard_manifest_names_the_unsharded_weight() {
    use glmcheck::diagnose::manifest::plan_manifest;
    use glmcheck::shard::identify::Dtype;

    let dir = common::scratch();
    let hf = dir.path().join("hf");
    synth_hf(&hf);
    let trace = dir.path().join("engine.trace");
    engine_run(&hf, "4", "unsharded-column", &trace);
    let kv_b = "model.layers.0.self_attn.kv_b_proj.weight";
    let mut manifest = plan_manifest(&common::weight_source(&hf), 4, false, Dtype::Bf16).unwrap();
    let rank0 = manifest.ranks[0]
        .weights
        .iter()
        .find(|w| w.name == kv_b)
        .cloned()
        .unwrap();
    for rank in &mut manifest.ranks {
        for w in rank.weights.iter_mut().filter(|w| w.name == kv_b) {
            *w = rank0.clone();
        }
    }
    let path = dir.path().join("shards.json");
    std::fs::write(&path, serde_json::to_string(&manifest).unwrap()).unwrap();
    let j = common::bisect_candidate(&hf, &trace, &["--actual", path.to_str().unwrap()], 1);
    assert_eq!(j["first_divergence"]["stage"], "L0.attn.kv");
    assert_eq!(j["fault"]["class"], "unsharded_weight");
    assert_eq!(j["fault"]["weight"], kv_b);
    assert_eq!(j["bisect"]["classified_by"], "shard manifest");
    let evidence = j["fault"]["evidence"].to_string();
    assert!(
        evidence.contains("on rank 3 holds rows 0..128 of 512")
            && evidence.contains("the plan gives rows 384..512"),
        "{evidence}"
    );
}

/// A run of a Q4_K_M GGUF recorded with the default recording (ids and most stages as
/// statistics) against the f32 reference of the same weights: judged against the reference with
/// every weight stored as the run's file stores it, and a top-k choice that a near tie flips,
/// seen only as another hash, is judged by the stages it feeds — an honest run passes. The same
/// run with softmax routing planted still fails, at the first MoE layer.
#[test]
fn a_quantized_run_kept_as_statistics_passes_against_the_f32_reference() {
    let dir = common::scratch();
    let (f32_model, q4) = (dir.path().join("f32.gguf"), dir.path().join("q4.gguf"));
    common::synth_tiny(&f32_model, &[]);
    common::synth_tiny(&q4, &["--quant", "q4_k_m"]);
    let run = |fault: Option<&str>, out: &Path| {
        let mut args = vec![
            "run",
            q4.to_str().unwrap(),
            "--tokens",
            TOKENS,
            "--json",
            "--out",
            out.to_str().unwrap(),
        ];
        if let Some(f) = fault {
            args.extend(["--inject", f]);
        }
        common::glmcheck_json(args, 0);
    };
    let honest = dir.path().join("honest.trace");
    run(None, &honest);
    let j = common::bisect_candidate(&f32_model, &honest, &[], 0);
    assert_eq!(j["verdict"], "pass", "{:#}", j["fault"]);
    assert_eq!(
        j["bisect"]["conversion"], true,
        "judged as the file stores it"
    );
    let stages = j["stages"].as_array().unwrap();
    let ids = stages
        .iter()
        .find(|s| s["stage"] == "L1.moe.topk_ids")
        .unwrap();
    assert_eq!(ids["basis"], "ids", "{ids:#}");

    // An engine's recorded config.json that does not parse is bad input: one line naming the
    // trace and the field, exit 2.
    let manifest = honest.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    m["model"]["config"] = serde_json::json!({"model_type": "glm_moe_dsa", "rms_norm_eps": "x"});
    std::fs::write(&manifest, m.to_string()).unwrap();
    let out = Command::new(common::glmcheck_bin())
        .args(["bisect", f32_model.to_str().unwrap(), "--candidate"])
        .arg(&honest)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("honest.trace") && err.contains("`rms_norm_eps`"),
        "{err}"
    );

    let faulty = dir.path().join("softmax.trace");
    run(Some("router-softmax"), &faulty);
    let j = common::bisect_candidate(&f32_model, &faulty, &[], 1);
    let stage = j["first_divergence"]["stage"].as_str().unwrap();
    assert!(stage.starts_with("L1.moe."), "{stage}: {:#}", j["fault"]);
    assert_eq!(j["fault"]["class"], "router_mismatch", "{:#}", j["fault"]);
}
