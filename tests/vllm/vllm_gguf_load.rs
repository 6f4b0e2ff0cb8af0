//! vLLM's own code with a glm-dsa GGUF: vLLM 0.23's CPU build (`scripts/setup-vllm`) builds
//! `GlmMoeDsaForCausalLM` in one gloo process per rank and loads a `glmcheck synth` Q4_K_M GGUF
//! through its own `weight_loader`s (`glmcheck_oracle.vllm23`: the user's loader patch and four CPU
//! platform shims).
//!
//! Loads: the probe writes each rank's shard manifest from vLLM's real parameters (GGUF
//! `qweight` bytes, merged layers, FusedMoE, vocab-parallel tables), and `glmcheck shards
//! --actual` judges it. Faithful loads pass at TP 2 and 4 with every shard identified; the
//! story's `kv_b_proj` loaded whole on every rank (each keeping its leading rows) is
//! `unsharded_weight` on every rank but 0; where vLLM's byte split cuts Q4_K blocks (the
//! default tiny model's 256-wide o_proj at TP 2), the shard is `wrong_shard_layout` naming the
//! block and byte; an F32 GGUF loads as floats, a version 1 manifest that passes; and the
//! engine's dequantization, asked for on the CPU build, is reported as not checked (the op is
//! absent there), never as a pass.
//!
//! Forwards: vLLM's forward runs with torch stand-ins for its GPU kernels
//! (`glmcheck_oracle.vllm23.gpu_stand_ins`) and the probe's hooks, and `glmcheck bisect MODEL
//! --candidate TRACE --actual SHARDS` judges the trace. Clean deployments pass at TP 2 and 4 in
//! f32 and at TP 2 in bf16 and f16; each of the story's faults is located and classified at TP 2
//! and 4: `kv_b_proj` whole on every rank (`unsharded_weight`, ranks and rows named), o_proj's
//! Q4_K blocks cut by the RowParallel split (`wrong_shard_layout`, block and byte), a
//! dequantization that drops Q4_K's high scale bits (`wrong_dequant` through the engine's own
//! dequantization, first block named), and fp16 without the layer-0 residual rescale. vLLM's
//! CPU rotary kernel, which rotates MLA's 3-D q wrongly, is a `rope_mismatch` at `L0.attn.q_rope`.
//!
//! The interpreter is `$GLMCHECK_VLLM_PYTHON`, else `.venv-vllm/bin/python`; missing, the
//! tests fail.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::Value;

/// The interpreter with vLLM 0.23.
fn vllm_python() -> PathBuf {
    common::vllm_python("GLMCHECK_VLLM_PYTHON", ".venv-vllm", "0.23")
}

/// A tiny model as a GGUF and its config folder; `aligned` widens o_proj's and the dense
/// down_proj's inputs (v_head_dim 128, intermediate 1024) so that TP 4 splits whole Q4_K blocks.
fn model(dir: &Path, aligned: bool) -> (PathBuf, PathBuf) {
    model_as(dir, aligned, "q4_k_m")
}

fn model_as(dir: &Path, aligned: bool, quant: &str) -> (PathBuf, PathBuf) {
    let sets: &[&str] = if aligned {
        &["--set", "v_head_dim=128", "--set", "intermediate_size=1024"]
    } else {
        &[]
    };
    let gguf = dir.join("model.gguf");
    let hf = dir.join("hf");
    common::synth_tiny(&gguf, &[sets, &["--quant", quant]].concat());
    common::synth_tiny(&hf, &[sets, &["--format", "hf"]].concat());
    (gguf, hf)
}

/// `vllm23.run_ranks` on `gguf` at `tp` with `extra` arguments into `out`.
fn run_ranks_output(gguf: &Path, hf: &Path, tp: u64, out: &Path, extra: &[&str]) -> Output {
    common::oracle_command(&vllm_python(), "vllm23.run_ranks")
        .arg(gguf)
        .arg("--hf-config")
        .arg(hf)
        .args(["--tp", &tp.to_string(), "--timeout", "500"])
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .expect("start the vLLM interpreter")
}

/// Run `vllm23.run_ranks` on `gguf` at `tp` with `extra` arguments into a folder of its own named
/// by `tag`; the folder (shards.json, and run.trace with `--tokens`).
fn run_ranks(gguf: &Path, hf: &Path, tp: u64, tag: &str, extra: &[&str]) -> PathBuf {
    let out = gguf.with_file_name(format!("tp{tp}-{tag}"));
    let run = run_ranks_output(gguf, hf, tp, &out, extra);
    assert!(
        run.status.success(),
        "vllm23.run_ranks at TP {tp} ({extra:?}) failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    out
}

/// Load `gguf` into vLLM at `tp` (with `fault`), and check the merged manifest: its exit code
/// and JSON, and the manifest.
fn load_and_check(gguf: &Path, hf: &Path, tp: u64, fault: Option<&str>) -> (i32, Value, Value) {
    let extra: Vec<&str> = fault.map(|f| vec!["--fault", f]).unwrap_or_default();
    let out = run_ranks(gguf, hf, tp, fault.unwrap_or("faithful"), &extra);
    let manifest = out.join("shards.json");
    let check = common::glmcheck_output(&[
        "shards",
        gguf.to_str().unwrap(),
        "--actual",
        manifest.to_str().unwrap(),
        "--json",
    ]);
    let verdict: Value = serde_json::from_slice(&check.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&check.stderr));
    });
    let m: Value = serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    (check.status.code().unwrap_or(-1), verdict, m)
}

fn entries(m: &Value) -> Vec<&Value> {
    m["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["weights"].as_array().unwrap())
        .collect()
}

fn faithful_then_unsharded_kv_b(tp: u64) {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);

    let (code, v, m) = load_and_check(&gguf, &hf, tp, None);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["verdict"], "pass");
    assert_eq!(v["ok"], v["checked"]);
    assert_eq!(v["not_in_manifest"], Value::Array(vec![]));
    // vLLM's real parameters: GGUF bytes per merged part and per expert half, floats where the
    // loader dequantized (kv_b_proj, the indexer's wk/weights_proj, the router).
    assert_eq!(m["version"], 2);
    let all = entries(&m);
    let quantized = |name: &str| {
        all.iter()
            .any(|e| e["name"] == name && e["ggml_type"].is_string())
    };
    for name in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.experts.gate_proj",
        "model.layers.1.mlp.experts.up_proj",
        "model.layers.1.mlp.experts.down_proj",
    ] {
        assert!(quantized(name), "{name}: no quantized entry");
    }
    let kv_b = "model.layers.0.self_attn.kv_b_proj.weight";
    assert!(all.iter().any(|e| e["name"] == kv_b && e["dtype"] == "f32"));
    assert_eq!(v["checked"].as_u64(), Some(all.len() as u64));

    let (code, v, _) = load_and_check(&gguf, &hf, tp, Some("unsharded-kv-b"));
    assert_eq!(code, 1, "{v:#}");
    assert_eq!(v["verdict"], "fail");
    let bad = v["mismatches"].as_array().unwrap();
    assert_eq!(bad.len() as u64, 3 * (tp - 1), "{bad:#?}");
    for layer in 0..3 {
        let weight = format!("model.layers.{layer}.self_attn.kv_b_proj.weight");
        let mut ranks: Vec<u64> = bad
            .iter()
            .filter(|x| x["weight"] == weight.as_str())
            .map(|x| {
                assert_eq!(x["class"], "unsharded_weight", "{x}");
                assert!(x["evidence"]
                    .as_str()
                    .unwrap()
                    .contains("same block as every rank"));
                x["rank"].as_u64().unwrap()
            })
            .collect();
        ranks.sort();
        assert_eq!(ranks, (1..tp).collect::<Vec<_>>(), "{weight}");
    }
}

#[test]
fn vllm_loads_at_tp2_faithfully_and_the_unsharded_kv_b_is_found() {
    faithful_then_unsharded_kv_b(2);
}

#[test]
fn vllm_loads_at_tp4_faithfully_and_the_unsharded_kv_b_is_found() {
    faithful_then_unsharded_kv_b(4);
}

#[test]
fn an_f32_gguf_loads_as_floats_in_a_version_1_manifest_that_passes() {
    let dir = common::scratch();
    let (gguf, hf) = model_as(dir.path(), false, "f32");
    let (code, v, m) = load_and_check(&gguf, &hf, 2, None);
    assert_eq!(code, 0, "{v:#}");
    assert_eq!(v["ok"], v["checked"]);
    assert_eq!(m["version"], 1);
    // F32 experts stay on vLLM's GGUF MoE method, as float `w13_qweight` / `w2_qweight`.
    let all = entries(&m);
    assert!(all
        .iter()
        .any(|e| e["name"] == "model.layers.1.mlp.experts.w13_weight" && e["dtype"] == "f32"));
}

#[test]
fn vllm_cutting_q4_k_blocks_is_a_wrong_shard_layout_naming_block_and_byte() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), false);
    let (code, v, _) = load_and_check(&gguf, &hf, 2, None);
    assert_eq!(code, 1, "{v:#}");
    let bad = v["mismatches"].as_array().unwrap();
    // o_proj's 256 inputs are one Q4_K block per row: each rank gets half of every block.
    assert_eq!(bad.len(), 6, "{bad:#?}");
    for x in bad {
        assert_eq!(x["class"], "wrong_shard_layout");
        let weight = x["weight"].as_str().unwrap();
        assert!(weight.ends_with("self_attn.o_proj.weight"), "{weight}");
        let evidence = x["evidence"].as_str().unwrap();
        assert!(
            evidence.contains("cut Q4_K blocks") && evidence.contains("byte 72 of block 0"),
            "{evidence}"
        );
    }
}

#[test]
fn the_engine_dequantization_asked_for_on_the_cpu_build_is_not_checked_and_says_so() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    let out = run_ranks(&gguf, &hf, 2, "check-dequant", &["--check-dequant"]);
    let manifest = out.join("shards.json");
    let args = [
        "shards",
        gguf.to_str().unwrap(),
        "--actual",
        manifest.to_str().unwrap(),
    ];
    let text = common::glmcheck_output(&args);
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert_eq!(text.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.contains("engine dequantization NOT checked on")
            && stdout.contains("ggml_dequantize: vllm._custom_ops.ggml_dequantize did not run"),
        "{stdout}"
    );
    let v = common::glmcheck_json([&args[..], &["--json"]].concat(), 0);
    assert_eq!(v["engine_dequant"]["equal"], 0, "{v:#}");
    assert!(!v["engine_dequant"]["not_run"]
        .as_array()
        .unwrap()
        .is_empty());
}

/// The prompt of the forward tests: 12 tokens, more than the tiny model's DSA top-k (4), so the
/// indexer's choice matters.
const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

/// vLLM's forward at `tp` in `dtype` (with `extra` arguments), judged by bisect with the run's
/// shard manifest; bisect's JSON report.
fn forward_bisect(gguf: &Path, hf: &Path, tp: u64, dtype: &str, extra: &[&str]) -> Value {
    let tag = format!("{dtype}-{}", extra.join("-").replace("--", ""));
    let args = [&["--tokens", TOKENS, "--dtype", dtype][..], extra].concat();
    let out = run_ranks(gguf, hf, tp, &tag, &args);
    let report = common::glmcheck_output(&[
        "bisect",
        gguf.to_str().unwrap(),
        "--candidate",
        out.join("run.trace").to_str().unwrap(),
        "--actual",
        out.join("shards.json").to_str().unwrap(),
        "--latent-norm-eps",
        "1e-5",
        "--json",
    ]);
    let v: Value = serde_json::from_slice(&report.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}", String::from_utf8_lossy(&report.stderr));
    });
    let code = if v["verdict"] == "pass" { 0 } else { 1 };
    assert_eq!(report.status.code(), Some(code), "{v:#}");
    v
}

fn assert_passes(v: &Value) {
    assert_eq!(v["verdict"], "pass", "{:#}", v["fault"]);
}

#[test]
fn vllm_forward_clean_at_tp2_and_tp4_in_f32_passes() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    for tp in [2, 4] {
        let v = forward_bisect(&gguf, &hf, tp, "float32", &[]);
        assert_passes(&v);
        assert!(v["tolerance_to_pass"].as_f64().unwrap() < 1e-10, "{v:#}");
    }
}

#[test]
fn vllm_forward_clean_at_tp2_in_bf16_and_f16_passes() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    for dtype in ["bfloat16", "float16"] {
        assert_passes(&forward_bisect(&gguf, &hf, 2, dtype, &[]));
    }
}

/// The fault's class, stage and evidence lines.
fn fault(v: &Value) -> (String, String, Vec<String>) {
    assert_eq!(v["verdict"], "fail", "{v:#}");
    let f = &v["fault"];
    let evidence = f["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_string())
        .chain([f["summary"].as_str().unwrap_or("").to_string()])
        .collect();
    (
        f["class"].as_str().unwrap().to_string(),
        v["first_divergence"]["stage"].as_str().unwrap().to_string(),
        evidence,
    )
}

/// vLLM's rotary embeddings built with 10× `rope_theta`, at TP 4 in bf16 with the probe's
/// default recording: the rotated stages are kept only as statistics of each rank's heads, and
/// a rotation leaves every moment as it was. Each rank's part is compared with its block of the
/// reference through the sketch, so the run fails at the first rotated stage.
#[test]
fn vllm_forward_with_rope_theta_times_10_fails_at_the_rotated_stage() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    let v = forward_bisect(&gguf, &hf, 4, "bfloat16", &["--fault", "rope-theta-10x"]);
    let (class, stage, evidence) = fault(&v);
    assert!(
        matches!(stage.as_str(), "L0.attn.q_rope" | "L0.attn.k_rope"),
        "{stage} {class}: {evidence:#?}"
    );
    assert_eq!(class, "rope_mismatch", "{evidence:#?}");
    println!(
        "rope-theta-10x: {stage} rank {}, {class}",
        v["first_divergence"]["rank"]
    );
}

/// vLLM run with a config.json whose `routed_scaling_factor` is not the model's (1.0 where the
/// GGUF's `expert_weights_scale` is 2.5: a `--hf-config-path` from another checkpoint). vLLM's
/// fused MoE never shows the routing weights it scales; the probe records the config vLLM's
/// model took, and bisect names the field and both values at the first stage it changes.
#[test]
fn vllm_forward_with_another_routed_scaling_factor_names_the_config_field() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    let other = dir.path().join("hf-other-scale");
    std::fs::create_dir(&other).unwrap();
    for entry in std::fs::read_dir(&hf).unwrap() {
        let from = entry.unwrap().path();
        std::fs::copy(&from, other.join(from.file_name().unwrap())).unwrap();
    }
    let config = other.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    assert_eq!(c["routed_scaling_factor"], 2.5);
    c["routed_scaling_factor"] = Value::from(1.0);
    std::fs::write(&config, c.to_string()).unwrap();
    let v = forward_bisect(&gguf, &other, 2, "float32", &[]);
    let (class, stage, evidence) = fault(&v);
    assert_eq!(class, "scale_mismatch", "{stage}: {evidence:#?}");
    assert_eq!(
        v["bisect"]["classified_by"], "engine config",
        "{evidence:#?}"
    );
    assert!(stage.starts_with("L1."), "{stage}: the first MoE layer");
    let summary = v["fault"]["summary"].as_str().unwrap();
    assert!(
        summary.contains("routed_scaling_factor = 1.0, where the reference's is 2.5"),
        "{summary}"
    );
    let path = &v["bisect"]["path"];
    assert!(
        path["keys"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k == "routed_scaling_factor"),
        "{path:#}"
    );
    println!("routed_scaling_factor 1.0: {stage}, {class}: {summary} (path {path})");
}

/// Faults in vLLM's collectives at TP 4 with the probe's default recording, each named from the
/// evidence the merged trace carries: layer 1's o_proj leaving out the all-reduce its
/// RowParallelLinear promises (rank 0's partial sum stands as the whole stage, and the ranks
/// whose copy differs are listed in `producer.disagree`); the logits gather handing back the
/// ranks' vocabulary blocks rotated by one (the reference's blocks in another order, with the
/// block map).
#[test]
fn vllm_forward_with_a_collective_broken_is_named_from_the_trace() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    let cases = [
        (
            "skip-o-proj-all-reduce",
            "L1.attn.out",
            "missing_all_reduce",
            "rank 1, 2, 3",
        ),
        (
            "logits-vocab-rotated",
            "logits",
            "wrong_shard_layout",
            "block 3 holds the reference's block 0",
        ),
    ];
    for (planted, want_stage, want_class, said) in cases {
        let v = forward_bisect(&gguf, &hf, 4, "float32", &["--fault", planted]);
        let (class, stage, evidence) = fault(&v);
        assert_eq!(stage, want_stage, "{planted}: {class}: {evidence:#?}");
        assert_eq!(class, want_class, "{planted}: {evidence:#?}");
        assert!(
            evidence.iter().any(|e| e.contains(said)),
            "{planted}: {evidence:#?}"
        );
        println!("{planted}: {stage}, {class}: {evidence:?}");
    }
}

#[test]
fn vllm_forward_with_kv_b_whole_on_every_rank_is_an_unsharded_weight() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    for tp in [2, 4] {
        let v = forward_bisect(&gguf, &hf, tp, "float32", &["--fault", "unsharded-kv-b"]);
        let (class, stage, evidence) = fault(&v);
        assert_eq!(class, "unsharded_weight", "{v:#}");
        // The heads' context is kept as each rank's statistics: compared with its block of the
        // reference, the rank holding rank 0's kv_b rows departs there.
        assert_eq!(stage, "L0.attn.ctx", "{v:#}");
        assert!(
            v["first_divergence"]["rank"].as_u64().unwrap() >= 1,
            "{v:#}"
        );
        let kv_b = "model.layers.0.self_attn.kv_b_proj.weight";
        assert_eq!(v["fault"]["weight"], kv_b);
        for rank in 1..tp {
            assert!(evidence
                .iter()
                .any(|e| e.contains(&format!("on rank {rank} holds rows 0.."))));
        }
    }
}

#[test]
fn vllm_forward_with_o_proj_blocks_cut_is_a_wrong_shard_layout() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), false);
    for (tp, byte) in [(2, 72), (4, 36)] {
        let v = forward_bisect(&gguf, &hf, tp, "float32", &[]);
        let (class, stage, evidence) = fault(&v);
        assert_eq!(
            (class.as_str(), stage.as_str()),
            ("wrong_shard_layout", "L0.attn.out")
        );
        assert_eq!(
            v["fault"]["weight"],
            "model.layers.0.self_attn.o_proj.weight"
        );
        assert!(
            evidence
                .iter()
                .any(|e| e.contains(&format!("byte {byte} of block 0"))),
            "{evidence:#?}"
        );
    }
}

#[test]
fn vllm_forward_with_q4_k_high_scales_dropped_is_a_wrong_dequant() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    for tp in [2, 4] {
        let extra = ["--fault", "q4k-high-scales", "--check-dequant"];
        let v = forward_bisect(&gguf, &hf, tp, "float32", &extra);
        let (class, _, evidence) = fault(&v);
        assert_eq!(class, "wrong_dequant", "{v:#}");
        assert!(
            evidence.iter().any(
                |e| e.contains("reads these Q4_K bytes differently from ggml")
                    && e.contains("first at block")
            ),
            "{evidence:#?}"
        );
    }
}

#[test]
fn vllm_forward_in_f16_without_the_residual_rescale_is_located_at_layer_0() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    for tp in [2, 4] {
        let v = forward_bisect(
            &gguf,
            &hf,
            tp,
            "float16",
            &["--fault", "fp16-no-residual-rescale"],
        );
        let (class, stage, evidence) = fault(&v);
        assert_eq!(
            (class.as_str(), stage.as_str()),
            ("scale_mismatch", "L0.attn_resid")
        );
        // The stream (embed) counts routed_scaling_factor (2.5) times the attention output.
        assert!(
            evidence.iter().any(|e| e.contains("one operand is 2.50")),
            "{evidence:#?}"
        );
    }
}

#[test]
fn vllm_cpu_rotary_kernel_on_mla_queries_is_a_rope_mismatch() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    // Every stage whole: the rotated q's rank parts are otherwise kept as statistics only, and
    // the first stage seen to differ would be the indexer's choice (its RoPE is wrong too).
    let v = forward_bisect(
        &gguf,
        &hf,
        2,
        "float32",
        &["--cpu-rope-kernel", "--full", "**"],
    );
    let (class, stage, _) = fault(&v);
    assert_eq!(
        (class.as_str(), stage.as_str()),
        ("rope_mismatch", "L0.attn.q_rope"),
        "{v:#}"
    );
}

/// A vLLM whose code has moved on (a class or a submodule renamed) makes the probe refuse,
/// naming the module, before any manifest or trace is written.
#[test]
fn a_renamed_vllm_makes_the_probe_fail_naming_the_module() {
    let dir = common::scratch();
    let (gguf, hf) = model(dir.path(), true);
    let cases = [
        (
            "--rename-class",
            "ColumnParallelLinear=ColumnParallelLinearV2",
            "model.layers.0.self_attn.q_b_proj: class ColumnParallelLinearV2 is not one this probe knows",
        ),
        (
            "--rename-module",
            "kv_b_proj=kv_up_proj",
            "kv_up_proj.weight: a parameter this probe does not know",
        ),
        (
            "--rename-class",
            "RotaryEmbedding=MRotaryEmbedding",
            "model.layers.0.self_attn.rotary_emb: class MRotaryEmbedding is not one this probe knows",
        ),
        (
            "--rename-class",
            "FusedMoE=FusedMoEV2",
            "model.layers.1.mlp.experts: class FusedMoEV2 is not one this probe knows",
        ),
    ];
    for (i, (flag, rename, message)) in cases.iter().enumerate() {
        let out = dir.path().join(format!("renamed{i}"));
        let run = run_ranks_output(&gguf, &hf, 2, &out, &[flag, rename, "--tokens", TOKENS]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{rename}: {stderr}");
        assert!(stderr.contains("UnknownModel"), "{rename}: {stderr}");
        assert!(stderr.contains(message), "{rename}: {stderr}");
        assert!(!out.join("shards.json").exists() && !out.join("run.trace").exists());
    }
}
