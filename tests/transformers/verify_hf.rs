//! `glmcheck verify` on a Hugging Face bf16 checkpoint that transformers itself wrote, against
//! the f32 folder it was cast from, and on copies with a fault planted in its safetensors bytes
//! (`glmcheck_oracle.hf.bf16_faults`).
//!
//! The honest bf16 folder is ggml's bf16 rounding of every value, so every tensor is `exact`;
//! each planted fault fails at its tensor with its class and relation, and only that tensor
//! (both tensors of a swapped pair).

use crate::common;

use serde_json::Value;

fn verify(reference: &str, candidate: &str, code: i32) -> Value {
    common::glmcheck_json(["verify", reference, candidate, "--json"], code)
}

#[test]
fn transformers_bf16_checkpoint_passes_and_planted_faults_are_named() {
    let dir = common::scratch();
    let f32_dir = dir.path().join("f32");
    common::synth_tiny(&f32_dir, &["--format", "hf", "--quant", "f32"]);
    let out = dir.path().join("bf16");
    let made: Value = serde_json::from_str(&common::run_oracle(
        "hf.bf16_faults",
        &[f32_dir.to_str().unwrap(), out.to_str().unwrap()],
    ))
    .expect("the oracle's JSON");
    let reference = f32_dir.to_str().unwrap();

    let honest = verify(reference, made["honest"]["dir"].as_str().unwrap(), 0);
    let s = &honest["summary"];
    assert_eq!(honest["verdict"], "pass");
    assert!(s["tensors"].as_u64().unwrap() > 50, "{s}");
    assert_eq!(s["exact"], s["tensors"], "{s}");

    // fault → (class, relation, tensors named)
    let expected = [
        ("double", "scale_mismatch", "scalar_multiple", 1),
        ("swap_experts", "weight_layout", "expert_permutation", 2),
        ("zero_bias", "router_mismatch", "zeros", 1),
        ("nan", "nan_origin", "nan_inf", 1),
    ];
    for (fault, class, relation, count) in expected {
        let planted = &made[fault];
        let tensor = planted["tensor"].as_str().unwrap();
        let r = verify(reference, planted["dir"].as_str().unwrap(), 1);
        let findings = r["findings"].as_array().unwrap();
        assert_eq!(findings.len(), count, "{fault}: {findings:#?}");
        let f = findings
            .iter()
            .find(|f| f["tensor"] == tensor)
            .unwrap_or_else(|| panic!("{fault}: {tensor} not named: {findings:#?}"));
        for f in findings {
            assert_eq!(
                (f["class"].as_str(), f["relation"].as_str()),
                (Some(class), Some(relation)),
                "{fault}: {f:#}"
            );
        }
        if fault == "swap_experts" {
            assert_eq!(f["map"], serde_json::json!([[1, 5]]), "{f:#}");
        }
        if fault == "double" {
            assert_eq!(f["factor"].as_f64(), Some(2.0), "{f:#}");
        }
    }
}
