//! Synthetic model sizes: named presets, then `--layers`, `--experts` and `--set key=value`.

use serde_json::Value as Json;

use crate::model::config::{ConfigError, Glm5Config};

/// The named starting points.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// CI speed: one dense and two MoE layers, vocab 384, hidden 256, DSA top-k 4.
    Tiny,
    /// A few hundred MB: benchmarks.
    Small,
    /// GLM-5's real widths (hidden 6144, 64 heads, 256 experts of 2048, vocab 154880);
    /// size it with `--layers` and `--experts`.
    Glm5Dims,
}

impl Preset {
    pub const ALL: [Preset; 3] = [Preset::Tiny, Preset::Small, Preset::Glm5Dims];

    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Small => "small",
            Preset::Glm5Dims => "glm5-dims",
        }
    }

    pub fn config(self) -> Glm5Config {
        let base = Glm5Config::glm5();
        match self {
            Preset::Tiny => Glm5Config {
                vocab_size: 384,
                hidden_size: 256,
                intermediate_size: 512,
                moe_intermediate_size: 128,
                num_hidden_layers: 3,
                num_attention_heads: 4,
                q_lora_rank: 128,
                kv_lora_rank: 64,
                qk_nope_head_dim: 32,
                qk_rope_head_dim: 16,
                v_head_dim: 32,
                n_routed_experts: 8,
                num_experts_per_tok: 2,
                first_k_dense_replace: 1,
                index_n_heads: 4,
                index_head_dim: 64,
                index_topk: 4,
                max_position_embeddings: 4096,
                ..with_layers(base, 3)
            },
            Preset::Small => Glm5Config {
                vocab_size: 8192,
                hidden_size: 1024,
                intermediate_size: 2816,
                moe_intermediate_size: 512,
                num_attention_heads: 16,
                q_lora_rank: 512,
                kv_lora_rank: 256,
                qk_nope_head_dim: 64,
                qk_rope_head_dim: 32,
                v_head_dim: 64,
                n_routed_experts: 32,
                num_experts_per_tok: 4,
                first_k_dense_replace: 1,
                index_n_heads: 8,
                index_head_dim: 64,
                index_topk: 64,
                max_position_embeddings: 8192,
                ..with_layers(base, 6)
            },
            Preset::Glm5Dims => with_layers(base, 4),
        }
    }
}

/// `cfg` with `layers` forward layers (every indexer full).
fn with_layers(cfg: Glm5Config, layers: u64) -> Glm5Config {
    Glm5Config {
        num_hidden_layers: layers,
        indexer_types: vec![crate::model::config::IndexerKind::Full; layers as usize],
        ..cfg
    }
}

/// Keys that are not config fields but decide the per-layer indexer schedule (GLM-5.2's
/// shared-indexer layers), as transformers reads them.
const INDEXER_SCHEDULE_KEYS: [&str; 3] = [
    "index_topk_freq",
    "index_skip_topk_offset",
    "index_topk_pattern",
];

/// Apply `key=value` overrides: each value is JSON when it parses as JSON (`1e6`, `true`,
/// `[..]`), else a string. The result goes through the same validation as a `config.json`.
pub fn apply_overrides(cfg: &Glm5Config, sets: &[String]) -> Result<Glm5Config, ConfigError> {
    let mut j = cfg.to_hf_json();
    let o = j.as_object_mut().expect("config JSON is an object");
    for set in sets {
        let (key, value) = set.split_once('=').ok_or_else(|| ConfigError {
            field: set.clone(),
            reason: "expected KEY=VALUE".into(),
        })?;
        let value = serde_json::from_str(value).unwrap_or_else(|_| Json::String(value.into()));
        let (key, value) = match key {
            "rope_theta" => (
                "rope_parameters",
                rope_with_theta(o.get("rope_parameters"), value),
            ),
            _ => (key, value),
        };
        if key == "num_hidden_layers" || INDEXER_SCHEDULE_KEYS.contains(&key) {
            o.remove("indexer_types");
        }
        o.insert(key.to_string(), value);
    }
    Glm5Config::from_hf_json(&j.to_string())
}

fn rope_with_theta(rope: Option<&Json>, theta: Json) -> Json {
    let mut rope = rope
        .cloned()
        .unwrap_or_else(|| serde_json::json!({"rope_type": "default"}));
    rope["rope_theta"] = theta;
    rope
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::IndexerKind;

    #[test]
    fn presets_are_valid_and_tiny_has_dense_and_moe_layers() {
        for p in [Preset::Tiny, Preset::Small, Preset::Glm5Dims] {
            p.config().validate().unwrap();
        }
        let t = Preset::Tiny.config();
        assert!(!t.is_moe_layer(0) && t.is_moe_layer(1) && t.is_moe_layer(2));
        assert!(t.index_topk < 16);
    }

    #[test]
    fn overrides_reach_the_config_and_the_indexer_schedule() {
        let base = Preset::Tiny.config();
        let sets = [
            "num_hidden_layers=8",
            "rope_theta=8e6",
            "index_topk_freq=4",
            "index_skip_topk_offset=3",
            "norm_topk_prob=false",
        ];
        let cfg = apply_overrides(&base, &sets.map(String::from)).unwrap();
        assert_eq!(cfg.num_hidden_layers, 8);
        assert_eq!(cfg.rope_theta, 8e6);
        assert!(!cfg.norm_topk_prob);
        // transformers' rule: full iff max(i − 3 + 1, 0) % 4 == 0.
        let full: Vec<bool> = cfg
            .indexer_types
            .iter()
            .map(|k| *k == IndexerKind::Full)
            .collect();
        assert_eq!(full, [true, true, true, false, false, false, true, false]);
        assert!(apply_overrides(&base, &["n_group=3".into()]).is_err());
        assert!(apply_overrides(&base, &["no_equals_sign".into()]).is_err());
    }

    #[test]
    fn hf_json_round_trips() {
        for p in [Preset::Tiny, Preset::Glm5Dims] {
            let cfg = p.config();
            assert_eq!(
                Glm5Config::from_hf_json(&cfg.to_hf_json().to_string()).unwrap(),
                cfg
            );
        }
    }
}
