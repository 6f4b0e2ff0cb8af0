//! vLLM's own code loading a glm-dsa GGUF: vLLM 0.23's CPU build (`scripts/setup-vllm`)
//! builds `GlmMoeDsaForCausalLM` in one gloo process per rank and loads a `glmcheck synth`
//! Q4_K_M GGUF through its own `weight_loader`s (`tests/oracle/vllm/`: the user's loader patch
//! and four CPU platform shims); the probe writes each rank's shard manifest from vLLM's real
//! parameters (GGUF `qweight` bytes, merged layers, FusedMoE, vocab-parallel tables), and
//! `glmcheck shards --actual` judges it. Faithful loads pass at TP 2 and 4 with every shard
//! identified; the story's `kv_b_proj` loaded whole on every rank (each keeping its leading
//! rows) is `unsharded_weight` on every rank but 0; and where vLLM's byte split cuts Q4_K
//! blocks (the default tiny model's 256-wide o_proj at TP 2), the shard is
//! `wrong_shard_layout` naming the block and byte. An F32 GGUF loads as floats, a version 1 manifest that
//! passes.
//!
//! The interpreter is `$GLMCHECK_VLLM_PYTHON`, else `.venv-vllm/bin/python`; missing, the
//! tests fail.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// The interpreter with vLLM 0.23.
fn vllm_python() -> PathBuf {
    let python = std::env::var_os("GLMCHECK_VLLM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| common::root().join(".venv-vllm/bin/python"));
    assert!(
        python.exists(),
        "{}: no vLLM interpreter; run scripts/setup-vllm or set GLMCHECK_VLLM_PYTHON",
        python.display()
    );
    python
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

/// Load `gguf` into vLLM at `tp` (with `fault`), and check the merged manifest: its exit code
/// and JSON, and the manifest.
fn load_and_check(gguf: &Path, hf: &Path, tp: u64, fault: Option<&str>) -> (i32, Value, Value) {
    let out = gguf.with_file_name(format!("tp{tp}-{}", fault.unwrap_or("faithful")));
    let mut cmd = Command::new(vllm_python());
    cmd.arg(common::root().join("tests/oracle/vllm/run_ranks.py"))
        .arg(gguf)
        .arg("--hf-config")
        .arg(hf)
        .args(["--tp", &tp.to_string(), "--timeout", "300"])
        .arg("--out")
        .arg(&out);
    if let Some(f) = fault {
        cmd.args(["--fault", f]);
    }
    let run = cmd.output().expect("start the vLLM interpreter");
    assert!(
        run.status.success(),
        "run_ranks.py at TP {tp} ({fault:?}) failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
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
