//! Synthetic GLM-5-architecture models in llama.cpp's `glm-dsa` GGUF layout.

mod encode;
mod rng;

use std::path::Path;

use crate::model::config::Glm5Config;
use crate::model::names::LayerWeight;
use crate::model::schema::{expected, ExpertForm, Family, KvBForm, Layout};
use crate::weights::gguf::writer::GgufWriter;
use crate::weights::gguf::{Value, ValueType};
use crate::weights::GgmlType;

pub use rng::SplitMix;

/// A GLM-5 small enough to build and run in milliseconds: one dense and two MoE layers, an MTP
/// layer, a DSA indexer whose top-k is below short sequence lengths.
pub fn tiny_config() -> Glm5Config {
    let layers = 3;
    Glm5Config {
        vocab_size: 256,
        hidden_size: 64,
        intermediate_size: 128,
        moe_intermediate_size: 32,
        num_hidden_layers: layers,
        num_nextn_predict_layers: 1,
        num_attention_heads: 4,
        q_lora_rank: 32,
        kv_lora_rank: 32,
        qk_nope_head_dim: 16,
        qk_rope_head_dim: 8,
        v_head_dim: 16,
        n_routed_experts: 8,
        n_shared_experts: 1,
        num_experts_per_tok: 2,
        first_k_dense_replace: 1,
        index_n_heads: 4,
        index_head_dim: 32,
        index_topk: 4,
        indexer_types: vec![crate::model::config::IndexerKind::Full; layers as usize],
        max_position_embeddings: 4096,
        ..Glm5Config::glm5()
    }
}

/// The `glm-dsa.*` metadata llama.cpp's converter writes for `cfg`.
pub fn gguf_metadata(cfg: &Glm5Config, name: &str) -> Vec<(String, Value)> {
    let u = |v: u64| Value::U32(v as u32);
    let f = |v: f64| Value::F32(v as f32);
    let arch = |k: &str| format!("glm-dsa.{k}");
    let mut md = vec![
        (
            "general.architecture".to_string(),
            Value::String("glm-dsa".into()),
        ),
        ("general.name".to_string(), Value::String(name.into())),
    ];
    let fields = [
        (
            "block_count",
            u(cfg.num_hidden_layers + cfg.num_nextn_predict_layers),
        ),
        ("context_length", u(cfg.max_position_embeddings)),
        ("embedding_length", u(cfg.hidden_size)),
        ("feed_forward_length", u(cfg.intermediate_size)),
        ("attention.head_count", u(cfg.num_attention_heads)),
        ("attention.head_count_kv", u(1)),
        (
            "attention.key_length",
            u(cfg.kv_lora_rank + cfg.qk_rope_head_dim),
        ),
        ("attention.value_length", u(cfg.kv_lora_rank)),
        ("attention.key_length_mla", u(cfg.qk_head_dim())),
        ("attention.value_length_mla", u(cfg.v_head_dim)),
        ("attention.q_lora_rank", u(cfg.q_lora_rank)),
        ("attention.kv_lora_rank", u(cfg.kv_lora_rank)),
        ("attention.layer_norm_rms_epsilon", f(cfg.rms_norm_eps)),
        ("rope.dimension_count", u(cfg.qk_rope_head_dim)),
        ("rope.freq_base", f(cfg.rope_theta)),
        ("leading_dense_block_count", u(cfg.first_k_dense_replace)),
        ("expert_count", u(cfg.n_routed_experts)),
        ("expert_used_count", u(cfg.num_experts_per_tok)),
        ("expert_shared_count", u(cfg.n_shared_experts)),
        ("expert_feed_forward_length", u(cfg.moe_intermediate_size)),
        ("expert_weights_scale", f(cfg.routed_scaling_factor)),
        ("expert_weights_norm", Value::Bool(cfg.norm_topk_prob)),
        (
            "expert_gating_func",
            u(if cfg.scoring_func == "softmax" { 1 } else { 2 }),
        ),
        ("expert_group_count", u(cfg.n_group)),
        ("expert_group_used_count", u(cfg.topk_group)),
        ("nextn_predict_layers", u(cfg.num_nextn_predict_layers)),
        ("attention.indexer.head_count", u(cfg.index_n_heads)),
        ("attention.indexer.key_length", u(cfg.index_head_dim)),
        ("attention.indexer.top_k", u(cfg.index_topk)),
        ("vocab_size", u(cfg.vocab_size)),
    ];
    md.extend(fields.into_iter().map(|(k, v)| (arch(k), v)));
    let tokens = (0..cfg.vocab_size)
        .map(|i| Value::String(format!("<t{i}>")))
        .collect();
    md.push(("tokenizer.ggml.model".into(), Value::String("gpt2".into())));
    md.push((
        "tokenizer.ggml.tokens".into(),
        Value::Array(ValueType::String, tokens),
    ));
    md
}

/// Storage type for a weight in the demo mix: vectors F32, embeddings F16, matrices Q8_0 where
/// rows hold whole 32-blocks, F16 otherwise (llama.cpp's fallback for odd row lengths).
fn demo_type(w: Option<LayerWeight>, shape: &[u64]) -> GgmlType {
    match (w, shape.len()) {
        (_, 1) => GgmlType::F32,
        (None, _) => GgmlType::F16,
        _ if shape[shape.len() - 1] % 32 == 0 => GgmlType::Q8_0,
        _ => GgmlType::F16,
    }
}

/// Write a GGUF of `cfg` with random, well-scaled weights (deterministic from `seed`).
pub fn write_gguf(cfg: &Glm5Config, path: &Path, seed: u64) -> std::io::Result<()> {
    let layout = Layout {
        family: Family::Gguf,
        kv_b: KvBForm::Split,
        experts: ExpertForm::Stacked,
    };
    let mut w = GgufWriter::new();
    for (k, v) in gguf_metadata(cfg, "glmcheck-synth") {
        w.metadata(k, v);
    }
    let mut rng = SplitMix::new(seed);
    for e in expected(cfg, layout)
        .into_iter()
        .filter(|e| !e.optional || e.name == "output.weight")
    {
        let role = match e.id {
            crate::model::names::WeightId::Layer(_, r) => Some(r),
            _ => None,
        };
        let values = random_weight(&mut rng, &e.shape, e.name.ends_with("norm.weight"));
        let ty = demo_type(role, &e.shape);
        w.tensor(e.name, ty, &e.shape, encode::encode(ty, &values));
    }
    w.write(path)
}

/// Norm weights near 1; matrices with std 1/sqrt(fan_in) so activations keep their scale.
fn random_weight(rng: &mut SplitMix, shape: &[u64], is_norm: bool) -> Vec<f32> {
    let n: u64 = shape.iter().product();
    let fan_in = *shape.last().unwrap_or(&1) as f32;
    (0..n)
        .map(|_| {
            if is_norm {
                1.0 + 0.1 * rng.normal()
            } else {
                rng.normal() / fan_in.sqrt()
            }
        })
        .collect()
}
