//! kv_b against transformers: a `GlmMoeDsaForCausalLM`'s `kv_b_proj`, split the way llama.cpp's
//! converter splits it (3-D, and 2-D with heads folded), is assembled back bit for bit; and the
//! Hugging Face folder `save_pretrained` writes passes glmcheck's schema check.

use crate::common;

use glmcheck::model::kv_b::{assemble_kv_b, KvBDims};
use glmcheck::weights::ModelFiles;
use serde_json::Value as Json;

#[test]
fn split_kv_b_assembles_back_bit_for_bit_and_hf_folder_passes_schema() {
    let dir = common::scratch();
    common::run_oracle("hf.kv_b_split", &[dir.path().to_str().unwrap()]);
    let dims: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("kv_b.json")).unwrap())
            .unwrap();
    let get = |k: &str| dims[k].as_u64().unwrap() as usize;
    let d = KvBDims {
        heads: get("heads"),
        kv_lora: get("kv_lora"),
        nope: get("nope"),
        v: get("v"),
    };
    let hf = ModelFiles::open(&dir.path().join("hf")).unwrap();
    for form in ["split.gguf", "folded.gguf"] {
        let gguf = ModelFiles::open(&dir.path().join(form)).unwrap();
        for layer in 0..get("layers") {
            let part = |n: &str| {
                gguf.dequantize(gguf.require(&format!("blk.{layer}.{n}.weight")).unwrap())
                    .unwrap()
            };
            let assembled = assemble_kv_b(&part("attn_k_b"), &part("attn_v_b"), d).unwrap();
            let original = hf
                .dequantize(
                    hf.require(&format!("model.layers.{layer}.self_attn.kv_b_proj.weight"))
                        .unwrap(),
                )
                .unwrap();
            assert_eq!(assembled.len(), original.len());
            let same = assembled
                .iter()
                .zip(&original)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{form} layer {layer}: assembled kv_b differs from transformers'"
            );
        }
    }

    let hf = dir.path().join("hf");
    let report = common::glmcheck_json(
        [
            std::ffi::OsStr::new("inspect"),
            "--json".as_ref(),
            hf.as_os_str(),
        ],
        0,
    );
    let schema = &report["schema"];
    assert_eq!(schema["ok"], true, "{schema:#}");
    assert_eq!(schema["report"]["layout"]["kv_b"], "whole");
    assert_eq!(schema["report"]["layout"]["experts"], "per_expert");
    let config: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("hf/config.json")).unwrap())
            .unwrap();
    for key in [
        "num_hidden_layers",
        "hidden_size",
        "kv_lora_rank",
        "n_routed_experts",
        "index_topk",
        "v_head_dim",
    ] {
        assert_eq!(report["config"][key], config[key], "config {key}");
    }
    assert_eq!(
        report["config"]["rope_theta"],
        config["rope_parameters"]["rope_theta"]
    );
}
