//! The MLA/MoE family in vLLM 0.32, run as its users run it: `glmcheck synth --family` Hugging
//! Face checkpoints loaded by vLLM's own loader into vLLM's own classes — `DeepseekV3ForCausalLM`
//! (DeepSeek-V3 and Kimi-K2), `DeepseekV2ForCausalLM` (V2, and V2-Lite's `q_proj` without a q
//! LoRA) from `deepseek_v2.py`, and GLM-4.7-Flash's `Glm4MoeLiteForCausalLM` — with vLLM's own
//! dense MLA kernels on the CPU (`CPU_MLA`: no glmcheck stand-in in the forward), recorded by
//! the probe in every worker.
//!
//! Clean runs pass `glmcheck bisect`: DeepSeek-V3 (four expert groups, two used, YaRN ×40) at
//! TP 1, 2 and 4 in f32 and at TP 2 in bf16, every other member at TP 2. Two bugs of the family's
//! features, planted inside vLLM by the tests' plugin (`glmcheck_oracle.vllm32`), are located and
//! classed on DeepSeek-V3 at TP 2: the CPU router ignoring the expert-group limit, and the MLA
//! attention leaving YaRN's mscale² out of its softmax scale.

use crate::common;
use crate::vllm32::{assert_clean, bisect, capture, family_model};

use serde_json::Value;

/// A clean capture of `family` at `tp` in `dtype` passes, from a trace of vLLM 0.32 holding the
/// router's choices, with vLLM's YaRN read as the reference's.
fn clean(family: &str, tp: u64, dtype: &str) {
    let dir = common::scratch();
    let hf = family_model(dir.path(), family);
    let (out, summary) = capture(&hf, "cpu", tp, dtype, None);
    assert_clean(
        &hf,
        (&out, &summary),
        tp,
        &format!("{family}, TP {tp} {dtype}"),
        &[
            "L0.attn.ctx",
            "L1.moe.topk_ids",
            "L1.moe.topk_weights",
            "logits",
        ],
    );
}

#[test]
fn deepseek_v3_in_vllm_s_own_class_and_mla_kernels_passes_at_tp1_2_and_4() {
    for tp in [1, 2, 4] {
        clean("deepseek-v3", tp, "float32");
    }
    clean("deepseek-v3", 2, "bfloat16");
}

#[test]
fn every_other_member_in_vllm_s_own_classes_passes_at_tp2() {
    for family in [
        "deepseek-v2",
        "deepseek-v2-lite",
        "kimi-k2",
        "glm-4.7-flash",
    ] {
        clean(family, 2, "float32");
    }
}

/// `fault` planted in vLLM, run on DeepSeek-V3 at TP 2: the diagnosis.
fn faulty_v3(fault: &str) -> Value {
    let dir = common::scratch();
    let hf = family_model(dir.path(), "deepseek-v3");
    let (out, _) = capture(&hf, "cpu", 2, "float32", Some(fault));
    let v = bisect(&hf, &out);
    assert_eq!(v["verdict"], "fail", "{fault}: {v:#}");
    v
}

#[test]
fn vllm_s_router_choosing_among_every_expert_group_is_a_router_mismatch_at_the_first_moe_layer() {
    let v = faulty_v3("group-limit-ignored");
    assert_eq!(v["fault"]["class"], "router_mismatch", "{v:#}");
    assert_eq!(v["first_divergence"]["stage"], "L1.moe.topk_ids", "{v:#}");
    // The reference's router logits routed again without the limit give vLLM's choices.
    let summary = v["fault"]["summary"].as_str().unwrap();
    assert!(
        summary.contains("the router chooses as with every expert group competing"),
        "{summary}"
    );
}

#[test]
fn vllm_s_attention_without_yarn_s_mscale_squared_is_a_softmax_scale_mismatch_at_layer_0() {
    let v = faulty_v3("yarn-mscale-dropped");
    let fault = &v["fault"];
    assert_eq!(fault["class"], "scale_mismatch", "{v:#}");
    assert_eq!(v["first_divergence"]["layer"], 0, "{v:#}");
    let summary = fault["summary"].as_str().unwrap();
    assert!(summary.contains("softmax scale"), "{summary}");
    assert!(summary.contains("mscale"), "{summary}");
}
