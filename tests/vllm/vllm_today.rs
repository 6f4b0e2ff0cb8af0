//! vLLM 0.32, run as its users run it: `python -m glmcheck_probe.vllm_capture` starts vLLM's CPU
//! build through its public `LLM` class at tensor parallelism 1, 2 and 4 (one worker process per
//! rank, gloo), on a `glmcheck synth --format hf` checkpoint loaded by vLLM's own safetensors
//! loader into each of vLLM's two GLM-5 model trees: the CPU tree (`deepseek_v2.py`
//! `GlmMoeDsaForCausalLM`) that vLLM builds on a CPU, and the CUDA tree
//! (`vllm/models/deepseek_v32/nvidia/`) that a GPU runs, built on the CPU with `--tree cuda`.
//! glmcheck's vLLM plugin (`probes/glmcheck_probe/vllm_plugin.py`, `vllm_cuda_tree.py`) stands
//! in for the GPU kernels (sparse MLA attention, the DSA indexer, the CUDA tree's fused norms
//! and rotations) and writes each rank's shard manifest as loaded; the probe, installed in every
//! worker through `collective_rpc`, records the forward.
//!
//! Clean runs of both trees pass `glmcheck bisect MODEL --candidate TRACE --actual SHARDS` in f32
//! and bf16 at TP 1, 2 and 4. Bugs planted inside vLLM's own code by the tests' plugin
//! (`glmcheck_oracle.vllm32`, `GLMCHECK_VLLM_FAULT`) are each located at their first divergent
//! stage and classed (the CUDA tree at TP 2 and 4, the CPU tree at TP 4): its loader cutting
//! `kv_b_proj` at rank 0's offset on every rank (the story's fault), its router ignoring the
//! correction bias, an o_proj all-reduce left out, RoPE positions off by one, the experts'
//! loader swapping gate and up, and the DSA indexer's rotary embedding built in the other pair
//! order (DeepSeek-V3.2's bug in vLLM, here on GLM-5), named by the rotation that gives vLLM's
//! choices.
//!
//! FP8 checkpoints and fused shared experts are in `vllm_today_fp8`, a running server and the
//! captures that cannot be made in `vllm_today_server`, GGUFs through vllm-gguf-plugin in
//! `vllm_today_gguf`; what they share in `vllm32`.

use crate::common;
use crate::vllm32::{assert_clean, assert_lists, bisect, capture, evidence, json, model, TREES};

use serde_json::Value;

/// Clean captures of both trees at `tp` in f32 and bf16: each passes, from a trace of vLLM
/// 0.32 that holds every stage the probe expects (the router's choices and the DSA top-k
/// among them), with a manifest written as loaded.
fn clean(tp: u64) {
    let dir = common::scratch();
    let hf = model(dir.path());
    for (tree, dtype) in TREES
        .into_iter()
        .flat_map(|t| ["float32", "bfloat16"].map(|d| (t, d)))
    {
        let (out, summary) = capture(&hf, tree, tp, dtype, None);
        let what = format!("{tree} tree, TP {tp} {dtype}");
        assert_clean(
            &hf,
            (&out, &summary),
            tp,
            &what,
            &[
                "embed",
                "L0.attn.index_topk",
                "L1.moe.topk_ids",
                "L1.moe.topk_weights",
                "L2.moe.shared",
                "logits",
            ],
        );
        let shards = json(&out.join("shards.json"));
        assert_eq!(shards["tp"], tp);
        assert_eq!(shards["producer"]["when"], "as loaded");
        assert_lists(
            &shards,
            &[
                "model.layers.0.self_attn.kv_b_proj.weight",
                "model.layers.1.mlp.experts.w13_weight",
                "model.layers.1.mlp.shared_experts.gate_up_proj.weight",
                "lm_head.weight",
            ],
        );
    }
}

#[test]
fn clean_captures_pass_at_tp1() {
    clean(1);
}

#[test]
fn clean_captures_pass_at_tp2() {
    clean(2);
}

#[test]
fn clean_captures_pass_at_tp4() {
    clean(4);
}

/// `fault` planted in vLLM, run by the CUDA tree (what GPUs run) at TP 2 and 4 and by the CPU
/// tree at TP 4: the diagnosis of each run.
fn faulty(fault: &str) -> Vec<(&'static str, u64, Value)> {
    let dir = common::scratch();
    let hf = model(dir.path());
    [("cuda", 2), ("cuda", 4), ("cpu", 4)]
        .into_iter()
        .map(|(tree, tp)| {
            let (out, _) = capture(&hf, tree, tp, "float32", Some(fault));
            let v = bisect(&hf, &out);
            assert_eq!(v["verdict"], "fail", "{fault}, {tree} tree, TP {tp}: {v:#}");
            (tree, tp, v)
        })
        .collect()
}

#[test]
fn kv_b_proj_cut_at_rank_0_on_every_rank_is_an_unsharded_weight_naming_ranks_and_rows() {
    for (tree, tp, v) in faulty("unsharded-kv-b") {
        let fault = &v["fault"];
        assert_eq!(
            fault["class"], "unsharded_weight",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert_eq!(
            fault["weight"], "model.layers.0.self_attn.kv_b_proj.weight",
            "{v:#}"
        );
        assert_eq!(v["first_divergence"]["layer"], 0, "{v:#}");
        let summary = fault["summary"].as_str().unwrap();
        assert!(
            summary.contains(&format!("{} of {tp} ranks", tp - 1)),
            "{summary}"
        );
        // 8 heads of 32 + 32 rows: every rank holds rank 0's rows.
        let rows = 512 / tp;
        let text = evidence(&v);
        for rank in 1..tp {
            assert!(
                text.contains(&format!(
                    "on rank {rank} holds rows 0..{rows} of 512, the same block as every rank; \
                     the plan gives rows {}..{}",
                    rank * rows,
                    (rank + 1) * rows
                )),
                "TP {tp} rank {rank}: {text}"
            );
        }
    }
}

#[test]
fn a_router_that_ignores_the_correction_bias_is_a_router_mismatch_at_the_first_moe_layer() {
    for (tree, tp, v) in faulty("router-bias-ignored") {
        assert_eq!(
            v["fault"]["class"], "router_mismatch",
            "{tree} tree, TP {tp}: {v:#}"
        );
        let stage = v["first_divergence"]["stage"].as_str().unwrap();
        assert!(
            stage == "L1.moe.topk_ids" || stage == "L1.moe.topk_weights",
            "{tree} tree, TP {tp}: {stage}"
        );
        // Another choice is named by the reference's logits routed again without the bias.
        if stage == "L1.moe.topk_ids" {
            let summary = v["fault"]["summary"].as_str().unwrap();
            assert!(
                summary.contains("the correction bias (e_score_correction_bias) left out"),
                "{tree} tree, TP {tp}: {summary}"
            );
        }
    }
}

#[test]
fn an_o_proj_all_reduce_left_out_is_a_missing_all_reduce_where_the_ranks_disagree() {
    for (tree, tp, v) in faulty("skip-o-proj-all-reduce") {
        assert_eq!(
            v["fault"]["class"], "missing_all_reduce",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert!(evidence(&v).contains("producer.disagree"), "{v:#}");
        // The CPU tree's o_proj all-reduces its output; the CUDA tree's leaves it as partial
        // sums, all-reduced where the residual is added before the post-attention norm.
        if tree == "cpu" {
            assert_eq!(v["first_divergence"]["stage"], "L1.attn.out", "{v:#}");
        } else {
            assert_eq!(v["first_divergence"]["stage"], "L1.attn_resid", "{v:#}");
            assert!(
                evidence(&v).contains("L1.attn.out is recorded as the ranks' partial sums"),
                "{v:#}"
            );
        }
    }
}

#[test]
fn rope_positions_off_by_one_are_a_rope_mismatch_at_the_first_rotation() {
    for (tree, tp, v) in faulty("rope-positions-shifted") {
        assert_eq!(
            v["fault"]["class"], "rope_mismatch",
            "{tree} tree, TP {tp}: {v:#}"
        );
        let stage = v["first_divergence"]["stage"].as_str().unwrap();
        assert!(
            stage == "L0.attn.q_rope" || stage == "L0.attn.k_rope",
            "{tree} tree, TP {tp}: {stage}"
        );
        assert!(evidence(&v).contains("positions"), "{v:#}");
    }
}

#[test]
fn experts_loaded_with_gate_and_up_swapped_are_a_weight_layout_of_w13_on_every_rank() {
    for (tree, tp, v) in faulty("w13-halves-swapped") {
        let fault = &v["fault"];
        assert_eq!(
            fault["class"], "weight_layout",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert_eq!(fault["weight"], "model.layers.1.mlp.experts.w13_weight");
        assert_eq!(v["first_divergence"]["layer"], 1, "{v:#}");
        let summary = fault["summary"].as_str().unwrap();
        assert!(
            summary.contains(&format!("{tp} of {tp} ranks")),
            "{summary}"
        );
    }
}

#[test]
fn an_indexer_rotating_the_other_pairs_is_an_indexer_mismatch_in_the_first_layer() {
    for (tree, tp, v) in faulty("indexer-rope-style-flipped") {
        assert_eq!(
            v["fault"]["class"], "indexer_mismatch",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert_eq!(
            v["first_divergence"]["stage"], "L0.attn.index_topk",
            "{tree} tree, TP {tp}: {v:#}"
        );
        // The reference's indexer inputs scored again in NeoX halves give vLLM's choices.
        let summary = v["fault"]["summary"].as_str().unwrap();
        assert!(
            summary.contains("rotated in NeoX halves where the model turns adjacent pairs"),
            "{tree} tree, TP {tp}: {summary}"
        );
    }
}
