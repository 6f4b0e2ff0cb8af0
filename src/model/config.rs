//! The configuration of a family member: one struct, filled from a Hugging Face `config.json`
//! or from a GGUF's `ARCH.*` metadata. A key left out takes the member's transformers config
//! default (`config.json`) or llama.cpp's loader default (GGUF).

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

pub use super::family::{Member, TopkMethod};

/// How a layer's DSA indexer runs: its own top-k (`Full`) or the previous full layer's (`Shared`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexerKind {
    Full,
    Shared,
}

/// The `model_type`s of config.json the executor runs: every member of the family.
pub const HF_MODEL_TYPES: [&str; 6] = [
    "glm_moe_dsa",
    "glm4_moe_lite",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "kimi_k2",
];

/// The GGUF architectures llama.cpp converts the family to.
pub const GGUF_ARCHS: [&str; 3] = ["glm-dsa", "deepseek2", "deepseek32"];

/// GLM-5.2's indexer types (llama.cpp's default for a glm-dsa GGUF whose context is 1048576 or
/// more and which has no `attention.indexer.types`): layers 0 and 1 full, then one full layer
/// in every four, through layer 77.
pub fn glm_5_2_indexer_types(layers: usize) -> Vec<IndexerKind> {
    (0..layers)
        .map(|l| match l < 2 || (l < 78 && (l - 2) % 4 == 0) {
            true => IndexerKind::Full,
            false => IndexerKind::Shared,
        })
        .collect()
}

/// YaRN rope scaling, when a checkpoint asks for it (GLM-5 does not; DeepSeek-V3 does), with
/// transformers' meaning of each field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: u64,
    /// Scales cos/sin; derived from the mscales when absent.
    pub attention_factor: Option<f64>,
    pub mscale: Option<f64>,
    /// Also scales the softmax: `× (0.1·mscale_all_dim·ln factor + 1)²`.
    pub mscale_all_dim: Option<f64>,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Round the correction range outward to whole dims.
    pub truncate: bool,
}

/// YaRN's `0.1·m·ln(scale) + 1` (1 for scale ≤ 1).
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl Yarn {
    /// The softmax scale's multiplier: DeepSeek-V3's `mscale²` from `mscale_all_dim`.
    pub fn softmax_factor(&self) -> f64 {
        self.mscale_all_dim
            .map_or(1.0, |m| yarn_mscale(self.factor, m).powi(2))
    }

    /// The real DeepSeek-V3 / Kimi-K2 YaRN settings' shape (mscale equal to mscale_all_dim, so
    /// cos/sin stay unscaled and only the softmax scale grows), for synthetic members.
    pub fn deepseek(factor: f64, original: u64) -> Yarn {
        Yarn {
            factor,
            original_max_position_embeddings: original,
            attention_factor: None,
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
        }
    }
}

/// Everything the forward needs to know about a checkpoint of the family.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Glm5Config {
    /// Which published model this is (GLM-5 where a trace predates the family).
    #[serde(default)]
    pub member: Member,
    pub vocab_size: u64,
    pub hidden_size: u64,
    /// Dense MLP width (the first `first_k_dense_replace` layers).
    pub intermediate_size: u64,
    pub moe_intermediate_size: u64,
    /// Layers of the forward, without the MTP layer(s).
    pub num_hidden_layers: u64,
    /// MTP (next-token prediction) layers stored after the forward's layers.
    pub num_nextn_predict_layers: u64,
    pub num_attention_heads: u64,
    /// 0: no q LoRA, `q_proj` straight from the hidden state (DeepSeek-V2-Lite).
    pub q_lora_rank: u64,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
    pub n_routed_experts: u64,
    pub n_shared_experts: u64,
    pub num_experts_per_tok: u64,
    pub first_k_dense_replace: u64,
    pub n_group: u64,
    pub topk_group: u64,
    pub routed_scaling_factor: f64,
    pub norm_topk_prob: bool,
    /// `sigmoid` (GLM-5) or `softmax`.
    pub scoring_func: String,
    #[serde(default)]
    pub topk_method: TopkMethod,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_interleave: bool,
    pub indexer_rope_interleave: bool,
    pub yarn: Option<Yarn>,
    pub index_n_heads: u64,
    pub index_head_dim: u64,
    pub index_topk: u64,
    /// One entry per forward layer.
    pub indexer_types: Vec<IndexerKind>,
    pub max_position_embeddings: u64,
    pub tie_word_embeddings: bool,
}

/// A config field that is missing or unusable.
#[derive(Debug, thiserror::Error)]
#[error("config field `{field}`: {reason}")]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

pub(super) fn cfg_err(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        reason: reason.into(),
    }
}

impl Glm5Config {
    /// GLM-5's published configuration (transformers' defaults plus the checkpoint's choices).
    pub fn glm5() -> Self {
        let layers = 78;
        Glm5Config {
            member: Member::Glm5,
            vocab_size: 154880,
            hidden_size: 6144,
            intermediate_size: 12288,
            moe_intermediate_size: 2048,
            num_hidden_layers: layers,
            num_nextn_predict_layers: 1,
            num_attention_heads: 64,
            q_lora_rank: 2048,
            kv_lora_rank: 512,
            qk_nope_head_dim: 192,
            qk_rope_head_dim: 64,
            v_head_dim: 256,
            n_routed_experts: 256,
            n_shared_experts: 1,
            num_experts_per_tok: 8,
            first_k_dense_replace: 3,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
            scoring_func: "sigmoid".into(),
            topk_method: TopkMethod::NoauxTc,
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            rope_interleave: true,
            indexer_rope_interleave: true,
            yarn: None,
            index_n_heads: 32,
            index_head_dim: 128,
            index_topk: 2048,
            indexer_types: vec![IndexerKind::Full; layers as usize],
            max_position_embeddings: 202752,
            tie_word_embeddings: false,
        }
    }

    /// The values `member`'s transformers config class gives a key `config.json` leaves out.
    pub fn hf_defaults(member: Member) -> Glm5Config {
        let glm = Glm5Config::glm5();
        let v3 = Glm5Config {
            member: Member::DeepseekV3,
            vocab_size: 129280,
            hidden_size: 7168,
            intermediate_size: 18432,
            num_hidden_layers: 61,
            num_attention_heads: 128,
            q_lora_rank: 1536,
            qk_nope_head_dim: 128,
            v_head_dim: 128,
            n_group: 8,
            topk_group: 4,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 4096,
            ..glm.clone()
        }
        .without_indexer();
        match member {
            Member::Glm5 => glm,
            Member::Glm47Flash => Glm5Config {
                member,
                hidden_size: 2048,
                intermediate_size: 10240,
                moe_intermediate_size: 1536,
                num_hidden_layers: 47,
                num_nextn_predict_layers: 0,
                num_attention_heads: 20,
                q_lora_rank: 768,
                n_routed_experts: 64,
                num_experts_per_tok: 4,
                first_k_dense_replace: 1,
                routed_scaling_factor: 1.8,
                ..glm
            }
            .without_indexer(),
            Member::DeepseekV2 => Glm5Config {
                member,
                vocab_size: 102400,
                hidden_size: 4096,
                intermediate_size: 11008,
                moe_intermediate_size: 1407,
                num_hidden_layers: 32,
                num_attention_heads: 32,
                n_routed_experts: 64,
                n_shared_experts: 2,
                num_experts_per_tok: 0,
                first_k_dense_replace: 0,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0,
                norm_topk_prob: false,
                scoring_func: "softmax".into(),
                topk_method: TopkMethod::Greedy,
                max_position_embeddings: 2048,
                ..v3
            },
            Member::DeepseekV3 => v3,
            Member::KimiK2 => Glm5Config { member, ..v3 },
            Member::DeepseekV32 => Glm5Config {
                member,
                index_n_heads: 64,
                index_head_dim: 128,
                index_topk: 2048,
                indexer_rope_interleave: false,
                max_position_embeddings: 163840,
                ..v3
            },
        }
    }

    pub fn qk_head_dim(&self) -> u64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether layer `l` uses the MoE block (otherwise the dense MLP).
    pub fn is_moe_layer(&self, l: u64) -> bool {
        l >= self.first_k_dense_replace && self.n_routed_experts > 0
    }

    /// Whether attention is DSA-sparse (GLM-5, DeepSeek-V3.2) rather than dense (DeepSeek-V3).
    pub fn has_dsa(&self) -> bool {
        self.index_n_heads > 0 && self.index_topk > 0
    }

    /// Whether layer `l` runs its own indexer (and so stores indexer weights).
    pub fn has_indexer(&self, l: u64) -> bool {
        self.has_dsa() && self.indexer_types.get(l as usize) != Some(&IndexerKind::Shared)
    }

    /// The same model without the DSA indexer: dense MLA (every member but GLM-5 and V3.2).
    pub fn without_indexer(self) -> Self {
        Glm5Config {
            index_n_heads: 0,
            index_head_dim: 0,
            index_topk: 0,
            indexer_types: Vec::new(),
            ..self
        }
    }

    /// The softmax scale's multiplier from YaRN (1 without).
    pub fn yarn_softmax_factor(&self) -> f64 {
        self.yarn.as_ref().map_or(1.0, Yarn::softmax_factor)
    }

    /// Whether the attention has a q LoRA (`q_a_proj`, its norm, `q_b_proj`).
    pub fn has_q_lora(&self) -> bool {
        self.q_lora_rank > 0
    }

    /// The `config.json` the member's transformers class loads for this config (the inverse of
    /// [`Self::from_hf_json`]).
    pub fn to_hf_json(&self) -> Json {
        let rope = match &self.yarn {
            None => serde_json::json!({"rope_type": "default", "rope_theta": self.rope_theta}),
            Some(y) => serde_json::json!({
                "rope_type": "yarn",
                "rope_theta": self.rope_theta,
                "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position_embeddings,
                "attention_factor": y.attention_factor,
                "mscale": y.mscale,
                "mscale_all_dim": y.mscale_all_dim,
                "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow,
                "truncate": y.truncate,
            }),
        };
        let mut j = serde_json::to_value(self).unwrap_or_default();
        let o = j.as_object_mut().expect("a struct serializes to an object");
        o.remove("yarn");
        o.remove("rope_theta");
        o.remove("member");
        o.insert("rope_parameters".into(), rope);
        o.insert(
            "architectures".into(),
            serde_json::json!([self.member.architecture()]),
        );
        o.insert("model_type".into(), self.member.model_type().into());
        if !self.has_q_lora() {
            o.insert("q_lora_rank".into(), Json::Null);
        }
        if !self.member.has_indexer() {
            for k in [
                "index_n_heads",
                "index_head_dim",
                "index_topk",
                "indexer_types",
            ] {
                o.remove(k);
            }
            o.remove("indexer_rope_interleave");
        }
        if self.member == Member::Glm47Flash {
            let kinds: Vec<&str> = (0..self.num_hidden_layers)
                .map(|l| {
                    if self.is_moe_layer(l) {
                        "sparse"
                    } else {
                        "dense"
                    }
                })
                .collect();
            o.insert("mlp_layer_types".into(), serde_json::json!(kinds));
        }
        o.insert(
            "num_key_value_heads".into(),
            self.num_attention_heads.into(),
        );
        o.insert("head_dim".into(), self.qk_rope_head_dim.into());
        o.insert("qk_head_dim".into(), self.qk_head_dim().into());
        o.insert("hidden_act".into(), "silu".into());
        o.insert("topk_method".into(), self.topk_method.name().into());
        o.insert("attention_bias".into(), false.into());
        j
    }

    /// Checks that keep later arithmetic (shapes, divisions, shard sizes) meaningful.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("vocab_size", self.vocab_size),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(cfg_err(name, "must be positive"));
            }
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(cfg_err(
                "qk_rope_head_dim",
                format!("{} is odd; RoPE rotates pairs", self.qk_rope_head_dim),
            ));
        }
        if self.has_dsa() && self.index_head_dim < self.qk_rope_head_dim {
            return Err(cfg_err(
                "index_head_dim",
                format!(
                    "{} is less than qk_rope_head_dim {}: the DSA indexer rotates the first \
                     qk_rope_head_dim values of each of its heads",
                    self.index_head_dim, self.qk_rope_head_dim
                ),
            ));
        }
        if self.has_dsa() && !self.has_q_lora() {
            return Err(cfg_err(
                "q_lora_rank",
                "is 0, but the DSA indexer projects its queries from the q LoRA",
            ));
        }
        if self.n_routed_experts > 0 && self.num_experts_per_tok == 0 {
            return Err(cfg_err(
                "num_experts_per_tok",
                "must be positive where the model has routed experts",
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(cfg_err(
                "num_experts_per_tok",
                format!(
                    "{} exceeds n_routed_experts {}",
                    self.num_experts_per_tok, self.n_routed_experts
                ),
            ));
        }
        if self.n_group == 0
            || self.topk_group > self.n_group
            || !self.n_routed_experts.is_multiple_of(self.n_group)
        {
            return Err(cfg_err(
                "n_group",
                format!(
                    "{} groups / topk_group {} do not divide {} experts",
                    self.n_group, self.topk_group, self.n_routed_experts
                ),
            ));
        }
        if !matches!(self.scoring_func.as_str(), "sigmoid" | "softmax") {
            return Err(cfg_err(
                "scoring_func",
                format!("`{}` is neither sigmoid nor softmax", self.scoring_func),
            ));
        }
        // Absurd sizes would only come from a hostile file; bound them so shapes cannot overflow.
        let limit = 1u64 << 24;
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("n_routed_experts", self.n_routed_experts),
            ("vocab_size", self.vocab_size),
        ] {
            if v > limit {
                return Err(cfg_err(name, format!("{v} is beyond any real model")));
            }
        }
        Ok(())
    }
}
