//! `glm-dsa` Q4_K_M GGUFs — one made by llama.cpp's converter and `llama-quantize --imatrix`,
//! others by `glmcheck synth` — run by vLLM 0.32 through `vllm-gguf-plugin` 0.0.5 with the
//! user's weights adapter for them (`glmcheck_oracle.vllm32.glm_dsa_gguf`): they pass at TP 1;
//! at TP 2 the plugin's own loader bug (rank 0's rows of every merged-column weight on every
//! rank) is found; with the plugin's fix, TP 2 and 4 pass, and the story's `kv_b_proj` fault,
//! the plugin's byte split of Q4_K blocks and a config without GLM-5's indexer RoPE style are
//! each located and classed.

use crate::common;
use crate::vllm32::{bisect, capture_served, evidence, json, shards_check, Served, GGUF_RANK_FIX};

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The tiny preset as a glm-dsa Q4_K_M GGUF in llama.cpp's layout (`kv_b_proj` split into
/// `attn_k_b` / `attn_v_b`), served by vLLM through vllm-gguf-plugin with the user's glm-dsa
/// patch, beside the Hugging Face folder that gives vLLM its config and tokenizer. `aligned`
/// widens o_proj's and the dense MLP's inputs (v_head_dim 128, intermediate 1024) so that
/// TP 4 splits only whole Q4_K blocks.
fn gguf_model(dir: &Path, aligned: bool) -> (PathBuf, PathBuf) {
    let mut sets = vec!["kv_lora_rank=512", "qk_rope_head_dim=64"];
    if aligned {
        sets.extend(["v_head_dim=128", "intermediate_size=1024"]);
    }
    let sets: Vec<&str> = sets.into_iter().flat_map(|s| ["--set", s]).collect();
    let gguf = dir.join("model.gguf");
    let hf = dir.join("hf");
    common::synth_tiny(&gguf, &[&sets[..], &["--quant", "q4_k_m"]].concat());
    common::synth_tiny(&hf, &[&sets[..], &["--format", "hf"]].concat());
    (gguf, hf)
}

/// A GGUF through the plugin: captures of `gguf` (config from `hf`) with `env`.
fn served_gguf<'a>(
    gguf: &'a Path,
    hf: &'a Path,
    env: &'a [(&'a str, &'a str)],
    label: &'a str,
) -> Served<'a> {
    Served {
        model: gguf,
        hf: Some(hf),
        env,
        label,
    }
}

const WITH_RANK_FIX: &[(&str, &str)] = &[(GGUF_RANK_FIX, "1")];

/// At TP 1 the plugin's loaders cut nothing: the GGUF passes on both trees, from a manifest of
/// the plugin's own parameters (the quantized bytes under their checkpoint names, with their
/// GGML types) and a trace of the forward through the plugin's layers.
#[test]
fn a_glm_dsa_gguf_through_vllm_gguf_plugin_passes_on_both_trees_at_tp1() {
    let dir = common::scratch();
    let (gguf, hf) = gguf_model(dir.path(), false);
    for (tree, dtype) in [("cpu", "float32"), ("cuda", "bfloat16")] {
        let (out, summary) =
            capture_served(&served_gguf(&gguf, &hf, &[], ""), tree, 1, dtype, None);
        assert_eq!(summary["notes"], Value::Array(vec![]), "{summary:#}");
        let v = bisect(&gguf, &out);
        assert_eq!(v["verdict"], "pass", "{tree} tree, {dtype}: {v:#}");
        let shards = json(&out.join("shards.json"));
        assert_eq!(shards["version"], 2, "a manifest of GGUF bytes");
        let weights = shards["ranks"][0]["weights"].as_array().unwrap();
        let type_of = |name: &str| {
            weights
                .iter()
                .find(|w| w["name"] == name)
                .unwrap_or_else(|| panic!("{name} not in the manifest"))["ggml_type"]
                .clone()
        };
        // Held as the file's blocks: a merged layer's part, the stacked experts, the table.
        assert_eq!(type_of("model.layers.0.mlp.gate_proj.weight"), "Q4_K");
        assert!(type_of("model.layers.1.mlp.experts.down_proj").is_string());
        assert!(type_of("model.embed_tokens.weight").is_string());
        // Rebuilt from attn_k_b / attn_v_b by the user's patch: floats.
        assert_eq!(
            type_of("model.layers.0.self_attn.kv_b_proj.weight"),
            Value::Null
        );
    }
}

/// A GLM-5 made by transformers, converted by llama.cpp's converter and quantized to Q4_K_M
/// with an importance matrix by `llama-quantize --imatrix` (`glmcheck_oracle.llamacpp.quants`),
/// at widths vLLM's MLA takes (kv_lora_rank 512, rope 64) and whose row splits at TP 2 keep
/// whole blocks; the GGUF and the Hugging Face folder transformers saved.
fn llama_cpp_gguf(dir: &Path) -> (PathBuf, PathBuf) {
    let oracle = common::root().join(".oracles/llama.cpp");
    let sets = [
        "kv_lora_rank=512",
        "qk_rope_head_dim=64",
        "v_head_dim=128",
        "moe_intermediate_size=512",
    ];
    let mut args = vec![
        dir.to_str().unwrap(),
        "--llama-cpp",
        oracle.to_str().unwrap(),
    ];
    args.extend(sets.iter().flat_map(|s| ["--set", s]));
    let printed = common::run_oracle("llamacpp.quants", &args);
    let v: Value = serde_json::from_str(printed.lines().last().unwrap()).unwrap();
    let file = |key: &str| PathBuf::from(v["files"][key].as_str().unwrap());
    (file("q4_k_m-imatrix"), file("hf"))
}

/// A folder with `hf`'s config and tokenizer (not its weights: vLLM reads the GGUF's), the
/// config given the routing and RoPE keys GLM-5's own config.json carries and transformers'
/// `GlmMoeDsaConfig` does not define (a config it writes has none) — without `topk_method` vLLM builds no correction bias and
/// the load fails; without `indexer_rope_interleave` its indexer rotates half-split (NeoX).
/// `indexer_interleave: false` leaves that one key out.
fn glm5_config(hf: &Path, name: &str, indexer_interleave: bool) -> PathBuf {
    let out = hf.with_file_name(name);
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(hf).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e != "safetensors") {
            std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
        }
    }
    let mut cfg = json(&out.join("config.json"));
    cfg["topk_method"] = "noaux_tc".into();
    cfg["scoring_func"] = "sigmoid".into();
    cfg["rope_interleave"] = true.into();
    if indexer_interleave {
        cfg["indexer_rope_interleave"] = true.into();
    }
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    out
}

/// A GGUF that llama.cpp's own tools made, at TP 2 on the CUDA tree:
/// * vllm-gguf-plugin 0.0.5 as released keeps rank 0's rows of every merged-column weight on
///   every rank (its loader narrows at a `tp_rank` vLLM 0.32 never passes): glmcheck locates it
///   in layer 0 and names the rows, the other half, and — through `glmcheck shards` — every
///   weight it reaches (the shared experts of each MoE layer), with no fault planted;
/// * with the plugin's fix, the run passes;
/// * served with a config that lost `indexer_rope_interleave`, vLLM's DSA indexer rotates its
///   keys half-split and chooses other keys: `indexer_mismatch` at layer 0's top-k.
#[test]
fn a_llama_cpp_imatrix_gguf_through_vllm_gguf_plugin_meets_its_tp_bug_and_passes_once_fixed() {
    let dir = common::scratch();
    let (gguf, hf) = llama_cpp_gguf(dir.path());
    let config = glm5_config(&hf, "glm5-config", true);
    let (out, _) = capture_served(
        &served_gguf(&gguf, &config, &[], ""),
        "cuda",
        2,
        "float32",
        None,
    );
    let v = bisect(&gguf, &out);
    let fault = &v["fault"];
    assert_eq!(fault["class"], "unsharded_weight", "{v:#}");
    assert_eq!(
        fault["weight"], "model.layers.0.mlp.gate_proj.weight",
        "{v:#}"
    );
    // The CUDA tree holds the MLP's output as partial sums: the first stage it shows whole
    // is the layer's output.
    assert_eq!(v["first_divergence"]["stage"], "L0.out", "{v:#}");
    let text = evidence(&v);
    for needle in [
        "model.layers.0.mlp.gate_proj.weight on rank 1 holds rows 0..256, the same block as \
         every rank; the plan gives rows 256..512",
        "the same on model.layers.0.mlp.up_proj.weight (rank 1)",
    ] {
        assert!(text.contains(needle), "{needle} not in: {text}");
    }
    // Every merged-column weight on rank 1, and nothing else: the dense MLP's halves and each
    // MoE layer's shared experts.
    let shards = shards_check(&gguf, &out);
    let mut wrong: Vec<(&str, &str, u64)> = shards["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            let (name, class) = (w["weight"].as_str(), w["class"].as_str());
            (name.unwrap(), class.unwrap(), w["rank"].as_u64().unwrap())
        })
        .collect();
    wrong.sort();
    let expected: Vec<String> = ["0.mlp", "1.mlp.shared_experts", "2.mlp.shared_experts"]
        .iter()
        .flat_map(|m| ["gate_proj", "up_proj"].map(|p| format!("model.layers.{m}.{p}.weight")))
        .collect();
    let expected: Vec<(&str, &str, u64)> = expected
        .iter()
        .map(|n| (n.as_str(), "unsharded_weight", 1))
        .collect();
    assert_eq!(wrong, expected);

    let fixed = served_gguf(&gguf, &config, WITH_RANK_FIX, "-fixed");
    let (out, _) = capture_served(&fixed, "cuda", 2, "float32", None);
    let v = bisect(&gguf, &out);
    assert_eq!(v["verdict"], "pass", "{v:#}");

    let half_split = glm5_config(&hf, "config-without-indexer-interleave", false);
    let served = served_gguf(&gguf, &half_split, WITH_RANK_FIX, "-half-split");
    let (out, _) = capture_served(&served, "cuda", 2, "float32", None);
    let v = bisect(&gguf, &out);
    assert_eq!(v["fault"]["class"], "indexer_mismatch", "{v:#}");
    assert_eq!(
        v["first_divergence"]["stage"], "L0.attn.index_topk",
        "{v:#}"
    );
}

/// With the plugin's fix, clean runs pass at TP 2 (CPU tree, f32) and TP 4 (CUDA tree, bf16);
/// the story's loader fault, `kv_b_proj` cut at rank 0's offset on every rank, is located and
/// classed at TP 4 with ranks and rows.
#[test]
fn with_the_plugins_fix_a_gguf_passes_at_tp2_and_tp4_and_the_unsharded_kv_b_is_found() {
    let dir = common::scratch();
    let (gguf, hf) = gguf_model(dir.path(), true);
    let served = served_gguf(&gguf, &hf, WITH_RANK_FIX, "-fixed");
    for (tree, tp, dtype) in [("cpu", 2, "float32"), ("cuda", 4, "bfloat16")] {
        let (out, _) = capture_served(&served, tree, tp, dtype, None);
        let v = bisect(&gguf, &out);
        assert_eq!(v["verdict"], "pass", "{tree} tree, TP {tp} {dtype}: {v:#}");
    }
    let (out, _) = capture_served(&served, "cuda", 4, "float32", Some("unsharded-kv-b"));
    let v = bisect(&gguf, &out);
    assert_eq!(v["fault"]["class"], "unsharded_weight", "{v:#}");
    assert_eq!(
        v["fault"]["weight"], "model.layers.0.self_attn.kv_b_proj.weight",
        "{v:#}"
    );
    assert_eq!(v["first_divergence"]["layer"], 0, "{v:#}");
    // 8 heads of (32 + 128) rows: every rank holds rank 0's 320.
    let text = evidence(&v);
    for rank in 1..4u64 {
        let needle = format!(
            "on rank {rank} holds rows 0..320 of 1280, the same block as every rank; the plan \
             gives rows {}..{}",
            rank * 320,
            (rank + 1) * 320
        );
        assert!(text.contains(&needle), "{needle} not in: {text}");
    }
}

/// The plugin's RowParallel split cuts bytes, not blocks: where o_proj's 256-wide rows (one
/// Q4_K block) are split in two, each rank holds half a block's bytes. glmcheck names the block
/// and the byte the plan's columns cut, on both ranks.
#[test]
fn o_proj_q4_k_blocks_cut_by_the_plugins_row_split_are_a_wrong_shard_layout() {
    let dir = common::scratch();
    let (gguf, hf) = gguf_model(dir.path(), false);
    let served = served_gguf(&gguf, &hf, WITH_RANK_FIX, "-fixed");
    let (out, _) = capture_served(&served, "cuda", 2, "float32", None);
    let v = bisect(&gguf, &out);
    assert_eq!(v["fault"]["class"], "wrong_shard_layout", "{v:#}");
    assert_eq!(
        v["fault"]["weight"], "model.layers.0.self_attn.o_proj.weight",
        "{v:#}"
    );
    // o_proj's output is partial sums in the CUDA tree, first seen whole in the residual.
    assert_eq!(v["first_divergence"]["stage"], "L0.attn_resid", "{v:#}");
    let text = evidence(&v);
    for (rank, bytes) in [(0, "0..72"), (1, "72..144")] {
        let needle = format!(
            "on rank {rank}: the plan's columns {} of 256 cut Q4_K blocks (256 elements, 144 \
             bytes): column 128 is element 128 of block 0; it holds bytes {bytes} of each row",
            if rank == 0 { "0..128" } else { "128..256" }
        );
        assert!(text.contains(&needle), "{needle} not in: {text}");
    }
}
