//! vLLM 0.32's FP8 block-scaled layers and its fused shared experts, run as its users run them
//! (`vllm32`): an FP8 checkpoint whose weights and block scales load as planned, block scales
//! cut at rank 0's offset, and the shared expert stored as a routed one and checked there.

use crate::common;
use crate::vllm32::{
    assert_lists, bisect, capture, evidence, json, model, shards_check, vllm_python,
};

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// GLM-5-FP8's layout (`synth --quant fp8`: FP8 E4M3 linear weights with 128×128 block scales)
/// with widths vLLM's FP8 block layers accept at TP 4: every rank's share of a split dimension
/// is whole 128-blocks (8 heads of 64 + 64, experts of 512).
fn fp8_model(dir: &Path) -> PathBuf {
    let hf = dir.join("fp8");
    let sets = [
        "kv_lora_rank=512",
        "qk_rope_head_dim=64",
        "qk_nope_head_dim=64",
        "v_head_dim=64",
        "moe_intermediate_size=512",
    ];
    let mut args = vec!["--format", "hf", "--quant", "fp8"];
    args.extend(sets.iter().flat_map(|s| ["--set", s]));
    common::synth_tiny(&hf, &args);
    hf
}

/// An FP8 checkpoint loaded by vLLM's own FP8 block-scaled layers (`Fp8LinearMethod`,
/// `Fp8MoEMethod`; on a CPU without AMX through the plugin's torch W8A16 stand-ins): clean runs
/// of both trees pass, and every rank's FP8 weight and its block scales are the plan's slices.
#[test]
fn an_fp8_checkpoint_passes_with_every_weight_and_block_scale_as_planned() {
    let dir = common::scratch();
    let hf = fp8_model(dir.path());
    for (tree, tp) in [("cpu", 2), ("cuda", 4)] {
        let (out, summary) = capture(&hf, tree, tp, "bfloat16", None);
        assert_eq!(summary["notes"], Value::Array(vec![]), "{summary:#}");
        let v = bisect(&hf, &out);
        assert_eq!(v["verdict"], "pass", "{tree} tree, TP {tp}: {v:#}");
        let checked = shards_check(&hf, &out);
        assert_eq!(checked["verdict"], "pass", "{checked:#}");
        assert_eq!(checked["checked"], checked["ok"], "{checked:#}");
        assert_lists(
            &json(&out.join("shards.json")),
            &[
                "model.layers.0.self_attn.kv_b_proj.weight",
                "model.layers.0.self_attn.kv_b_proj.weight_scale_inv",
                "model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv",
                "model.layers.1.mlp.experts.w13_weight_scale_inv",
                "model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv",
            ],
        );
    }
}

/// vLLM's loader cutting `kv_b_proj`'s FP8 block scales at rank 0's offset on every rank while
/// the weight itself is cut right: `unsharded_weight` of `weight_scale_inv`, each rank's scale
/// rows named, the weight they scale matching no slice.
#[test]
fn fp8_block_scales_cut_at_rank_0_are_an_unsharded_weight_scale_inv() {
    let dir = common::scratch();
    let hf = fp8_model(dir.path());
    for (tree, tp) in [("cpu", 2), ("cuda", 4)] {
        let (out, _) = capture(&hf, tree, tp, "bfloat16", Some("kv-b-scales-unsharded"));
        let v = bisect(&hf, &out);
        assert_eq!(v["verdict"], "fail", "{tree} tree, TP {tp}: {v:#}");
        let fault = &v["fault"];
        assert_eq!(
            fault["class"], "unsharded_weight",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert_eq!(
            fault["weight"], "model.layers.0.self_attn.kv_b_proj.weight_scale_inv",
            "{v:#}"
        );
        assert_eq!(v["first_divergence"]["layer"], 0, "{v:#}");
        // 8 heads of 64 + 64 rows: 1024 rows, 8 scale rows.
        let rows = 8 / tp;
        let text = evidence(&v);
        for rank in 1..tp {
            assert!(
                text.contains(&format!(
                    "weight_scale_inv on rank {rank} holds rows 0..{rows} of 8, the same block \
                     as every rank; the plan gives rows {}..{}",
                    rank * rows,
                    (rank + 1) * rows
                )),
                "{tree} tree, TP {tp}, rank {rank}: {text}"
            );
        }
        assert!(
            text.contains("kv_b_proj.weight on rank 1: its statistics match no slice"),
            "{text}"
        );
    }
}

/// vLLM's fused shared experts (ROCm AITER's layout, turned on for a load on the CPU by the
/// tests' plugin): the shared expert is stored as expert 8 of `w13_weight` / `w2_weight`, cut
/// like a routed expert, and no `shared_experts` weight is left. `vllm_capture --shards-only`
/// writes the load's manifest; `glmcheck shards --actual` plans the fused slot from the shared
/// expert's checkpoint weights and checks it, and finds the slot's gate and up swapped.
#[test]
fn fused_shared_experts_are_planned_and_checked_in_the_stacked_experts() {
    let dir = common::scratch();
    let hf = model(dir.path());
    for tp in [2, 4] {
        for fault in [None, Some("fused-shared-halves-swapped")] {
            let out = dir
                .path()
                .join(format!("fused-tp{tp}-{}", fault.unwrap_or("clean")));
            let mut cmd = Command::new(vllm_python());
            cmd.args(["-m", "glmcheck_probe.vllm_capture"])
                .arg(&hf)
                .args([
                    "--tp",
                    &tp.to_string(),
                    "--shards-only",
                    "--dtype",
                    "float32",
                ])
                .arg("--out")
                .arg(&out)
                .env("GLMCHECK_VLLM_FUSE_SHARED_EXPERTS", "1");
            match fault {
                Some(f) => cmd.env("GLMCHECK_VLLM_FAULT", f),
                None => cmd.env_remove("GLMCHECK_VLLM_FAULT"),
            };
            let run = cmd.output().expect("start vllm_capture");
            assert!(
                run.status.success(),
                "TP {tp} {fault:?}: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            let shards = json(&out.join("shards.json"));
            let weights = shards["ranks"][0]["weights"].as_array().unwrap();
            let w13 = weights
                .iter()
                .find(|w| w["name"] == "model.layers.1.mlp.experts.w13_weight")
                .unwrap();
            assert_eq!(w13["shape"][0], 9, "8 routed experts and the shared one");
            assert!(
                !weights
                    .iter()
                    .any(|w| w["name"].as_str().unwrap().contains("shared_experts")),
                "no separate shared expert when fused"
            );
            let checked = shards_check(&hf, &out);
            assert_eq!(
                checked["not_in_manifest"],
                Value::Array(vec![]),
                "{checked:#}"
            );
            let mismatched: Vec<(&str, &str)> = checked["mismatches"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| (m["weight"].as_str().unwrap(), m["class"].as_str().unwrap()))
                .collect();
            if fault.is_none() {
                assert_eq!(checked["verdict"], "pass", "TP {tp}: {checked:#}");
            } else {
                // Both MoE layers, every rank: w13 only, its fused slot's halves swapped.
                assert_eq!(mismatched.len(), 2 * tp as usize, "{checked:#}");
                for (name, class) in mismatched {
                    assert!(name.ends_with("mlp.experts.w13_weight"), "{checked:#}");
                    assert_eq!(class, "weight_layout", "{checked:#}");
                }
            }
        }
    }
}
