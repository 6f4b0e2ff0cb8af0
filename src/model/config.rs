//! The GLM-5 configuration: one struct, filled from a Hugging Face `config.json` or from the
//! `glm-dsa.*` metadata of a GGUF. Defaults are transformers' `GlmMoeDsaConfig` defaults.

use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::weights::gguf::{GgufModel, Value};

/// How a layer's DSA indexer runs: its own top-k (`Full`) or the previous full layer's (`Shared`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexerKind {
    Full,
    Shared,
}

/// The `model_type`s of config.json the executor runs: GLM-5 and the DeepSeek MLA models whose
/// transformers classes exercise its NeoX RoPE, YaRN and dense-attention paths.
pub const HF_MODEL_TYPES: [&str; 3] = ["glm_moe_dsa", "deepseek_v3", "deepseek_v32"];

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

/// Everything the GLM-5 forward needs to know about a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Glm5Config {
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

fn cfg_err(field: &str, reason: impl Into<String>) -> ConfigError {
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

    /// Parse a Hugging Face `config.json`: `GlmMoeDsaForCausalLM`, or the DeepSeek MLA
    /// models transformers implements beside it, read as transformers' classes run them —
    /// `deepseek_v3` has no DSA indexer; `deepseek_v32`'s indexer rotates NeoX halves and never
    /// shares its selection.
    pub fn from_hf_json(text: &str) -> Result<Self, ConfigError> {
        let j: Json = serde_json::from_str(text).map_err(|e| cfg_err("(json)", e.to_string()))?;
        let model_type = j
            .get("model_type")
            .and_then(Json::as_str)
            .unwrap_or("glm_moe_dsa");
        let mut cfg = Self::from_glm_json(&j)?;
        match model_type {
            "glm_moe_dsa" => {}
            "deepseek_v3" => {
                cfg.index_n_heads = 0;
                cfg.index_topk = 0;
                cfg.indexer_types.clear();
            }
            "deepseek_v32" => {
                cfg.indexer_rope_interleave = false;
                cfg.indexer_types = vec![IndexerKind::Full; cfg.num_hidden_layers as usize];
            }
            other => {
                return Err(cfg_err(
                    "model_type",
                    format!("`{other}` is not glm_moe_dsa, deepseek_v3 or deepseek_v32"),
                ))
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// The fields of a `GlmMoeDsaForCausalLM` config.json, GLM-5's values where absent.
    fn from_glm_json(j: &Json) -> Result<Self, ConfigError> {
        let d = Glm5Config::glm5();
        let u = |k: &str, default: u64| {
            json_field(j, k, default, Json::as_u64, "a non-negative integer")
        };
        let f = |k: &str, default: f64| json_field(j, k, default, Json::as_f64, "a number");
        let b = |k: &str, default: bool| json_field(j, k, default, Json::as_bool, "a boolean");
        let layers = u("num_hidden_layers", d.num_hidden_layers)?;
        let rope = j
            .get("rope_parameters")
            .or_else(|| j.get("rope_scaling"))
            .filter(|v| v.is_object());
        let rope_theta = match rope.and_then(|r| r.get("rope_theta")) {
            Some(v) => v.as_f64().ok_or_else(|| {
                cfg_err("rope_parameters.rope_theta", format!("{v} is not a number"))
            })?,
            None => f("rope_theta", 10000.0)?,
        };
        Ok(Glm5Config {
            vocab_size: u("vocab_size", d.vocab_size)?,
            hidden_size: u("hidden_size", d.hidden_size)?,
            intermediate_size: u("intermediate_size", d.intermediate_size)?,
            moe_intermediate_size: u("moe_intermediate_size", d.moe_intermediate_size)?,
            num_hidden_layers: layers,
            num_nextn_predict_layers: u("num_nextn_predict_layers", 0)?,
            num_attention_heads: u("num_attention_heads", d.num_attention_heads)?,
            q_lora_rank: u("q_lora_rank", d.q_lora_rank)?,
            kv_lora_rank: u("kv_lora_rank", d.kv_lora_rank)?,
            qk_nope_head_dim: u("qk_nope_head_dim", d.qk_nope_head_dim)?,
            qk_rope_head_dim: u("qk_rope_head_dim", d.qk_rope_head_dim)?,
            v_head_dim: u("v_head_dim", d.v_head_dim)?,
            n_routed_experts: u("n_routed_experts", d.n_routed_experts)?,
            n_shared_experts: u("n_shared_experts", d.n_shared_experts)?,
            num_experts_per_tok: u("num_experts_per_tok", d.num_experts_per_tok)?,
            first_k_dense_replace: u("first_k_dense_replace", d.first_k_dense_replace)?,
            n_group: u("n_group", d.n_group)?,
            topk_group: u("topk_group", d.topk_group)?,
            routed_scaling_factor: f("routed_scaling_factor", d.routed_scaling_factor)?,
            norm_topk_prob: b("norm_topk_prob", d.norm_topk_prob)?,
            scoring_func: j
                .get("scoring_func")
                .and_then(Json::as_str)
                .unwrap_or("sigmoid")
                .to_string(),
            rms_norm_eps: f("rms_norm_eps", d.rms_norm_eps)?,
            rope_theta,
            rope_interleave: b("rope_interleave", true)?,
            indexer_rope_interleave: b("indexer_rope_interleave", true)?,
            yarn: rope.map(yarn_from_json).transpose()?.flatten(),
            index_n_heads: u("index_n_heads", d.index_n_heads)?,
            index_head_dim: u("index_head_dim", d.index_head_dim)?,
            index_topk: u("index_topk", d.index_topk)?,
            indexer_types: hf_indexer_types(j, layers)?,
            max_position_embeddings: u("max_position_embeddings", d.max_position_embeddings)?,
            tie_word_embeddings: b("tie_word_embeddings", false)?,
        })
    }

    /// The `config.json` transformers' `GlmMoeDsaForCausalLM` loads for this config (the
    /// inverse of [`Self::from_hf_json`]).
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
        o.insert("rope_parameters".into(), rope);
        o.insert(
            "architectures".into(),
            serde_json::json!(["GlmMoeDsaForCausalLM"]),
        );
        o.insert("model_type".into(), "glm_moe_dsa".into());
        o.insert(
            "num_key_value_heads".into(),
            self.num_attention_heads.into(),
        );
        o.insert("head_dim".into(), self.qk_rope_head_dim.into());
        o.insert("qk_head_dim".into(), self.qk_head_dim().into());
        o.insert("hidden_act".into(), "silu".into());
        o.insert("topk_method".into(), "noaux_tc".into());
        o.insert("attention_bias".into(), false.into());
        j
    }

    /// Read the `glm-dsa.*` metadata a llama.cpp conversion writes.
    pub fn from_gguf(model: &GgufModel) -> Result<Self, ConfigError> {
        let arch = model.architecture().unwrap_or("glm-dsa").to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let get = |k: &str| model.get(&key(k));
        let u = |k: &str| -> Result<Option<u64>, ConfigError> {
            get(k)
                .map(|v| {
                    v.as_u64()
                        .ok_or_else(|| cfg_err(&key(k), format!("{v} is not a count")))
                })
                .transpose()
        };
        let req = |k: &str| -> Result<u64, ConfigError> {
            u(k)?.ok_or_else(|| cfg_err(&key(k), "missing from the GGUF metadata"))
        };
        let f = |k: &str| -> Result<Option<f64>, ConfigError> {
            get(k)
                .map(|v| {
                    v.as_f64()
                        .ok_or_else(|| cfg_err(&key(k), format!("{v} is not a number")))
                })
                .transpose()
        };
        let d = Glm5Config::glm5();
        let nextn = u("nextn_predict_layers")?.unwrap_or(0);
        let blocks = req("block_count")?;
        let layers = blocks.checked_sub(nextn).ok_or_else(|| {
            cfg_err(
                &key("nextn_predict_layers"),
                format!("{nextn} exceeds block_count {blocks}"),
            )
        })?;
        let rope = req("rope.dimension_count")?;
        let key_mla = u("attention.key_length_mla")?.unwrap_or(d.qk_head_dim());
        let vocab = match u("vocab_size")? {
            Some(v) => v,
            None => model
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(|a| a.len() as u64)
                .unwrap_or(0),
        };
        let scoring = match u("expert_gating_func")? {
            None | Some(2) => "sigmoid",
            Some(1) => "softmax",
            Some(other) => {
                return Err(cfg_err(
                    &key("expert_gating_func"),
                    format!("unknown gating function {other}"),
                ))
            }
        };
        let indexer_types = match get("attention.indexer.types").and_then(Value::as_array) {
            Some(items) => items
                .iter()
                .take(layers as usize)
                .map(
                    |v| match v.as_bool().or_else(|| v.as_u64().map(|n| n != 0)) {
                        Some(true) => Ok(IndexerKind::Full),
                        Some(false) => Ok(IndexerKind::Shared),
                        None => Err(cfg_err(
                            &key("attention.indexer.types"),
                            format!("{v} is not a bool"),
                        )),
                    },
                )
                .collect::<Result<Vec<_>, _>>()?,
            // GLM-5 and 5.1 (a context below 1048576) run every indexer; past it llama.cpp
            // takes GLM-5.2's pattern.
            None => match u("context_length")?.unwrap_or(0) < 1 << 20 {
                true => vec![IndexerKind::Full; layers as usize],
                false => glm_5_2_indexer_types(layers as usize),
            },
        };
        let cfg = Glm5Config {
            vocab_size: vocab,
            hidden_size: req("embedding_length")?,
            intermediate_size: u("feed_forward_length")?.unwrap_or(0),
            moe_intermediate_size: u("expert_feed_forward_length")?.unwrap_or(0),
            num_hidden_layers: layers,
            num_nextn_predict_layers: nextn,
            num_attention_heads: req("attention.head_count")?,
            q_lora_rank: req("attention.q_lora_rank")?,
            kv_lora_rank: req("attention.kv_lora_rank")?,
            qk_nope_head_dim: key_mla.checked_sub(rope).ok_or_else(|| {
                cfg_err(
                    &key("attention.key_length_mla"),
                    format!("{key_mla} is smaller than the rope dims {rope}"),
                )
            })?,
            qk_rope_head_dim: rope,
            v_head_dim: u("attention.value_length_mla")?.unwrap_or(d.v_head_dim),
            n_routed_experts: u("expert_count")?.unwrap_or(0),
            n_shared_experts: u("expert_shared_count")?.unwrap_or(0),
            num_experts_per_tok: u("expert_used_count")?.unwrap_or(0),
            first_k_dense_replace: u("leading_dense_block_count")?.unwrap_or(0),
            n_group: u("expert_group_count")?.unwrap_or(1),
            topk_group: u("expert_group_used_count")?.unwrap_or(1),
            routed_scaling_factor: f("expert_weights_scale")?.unwrap_or(1.0),
            norm_topk_prob: get("expert_weights_norm")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            scoring_func: scoring.into(),
            rms_norm_eps: f("attention.layer_norm_rms_epsilon")?.unwrap_or(d.rms_norm_eps),
            rope_theta: f("rope.freq_base")?.unwrap_or(10000.0),
            // llama.cpp runs glm-dsa with NORM (adjacent-pair) RoPE for both MLA and the indexer.
            rope_interleave: true,
            indexer_rope_interleave: true,
            yarn: gguf_yarn(&f, &u)?,
            index_n_heads: u("attention.indexer.head_count")?.unwrap_or(0),
            index_head_dim: u("attention.indexer.key_length")?.unwrap_or(0),
            index_topk: u("attention.indexer.top_k")?.unwrap_or(0),
            indexer_types,
            max_position_embeddings: u("context_length")?.unwrap_or(0),
            tie_word_embeddings: false,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that keep later arithmetic (shapes, divisions, shard sizes) meaningful.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("q_lora_rank", self.q_lora_rank),
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

/// `j[key]` converted by `conv`, `default` when absent or null, an error naming the key otherwise.
fn json_field<T>(
    j: &Json,
    key: &str,
    default: T,
    conv: fn(&Json) -> Option<T>,
    what: &str,
) -> Result<T, ConfigError> {
    match j.get(key) {
        None | Some(Json::Null) => Ok(default),
        Some(v) => conv(v).ok_or_else(|| cfg_err(key, format!("{v} is not {what}"))),
    }
}

fn yarn_from_json(r: &Json) -> Result<Option<Yarn>, ConfigError> {
    let ty = r
        .get("rope_type")
        .or_else(|| r.get("type"))
        .and_then(Json::as_str)
        .unwrap_or("default");
    if ty != "yarn" {
        return Ok(None);
    }
    let num = |k: &str, default: f64| r.get(k).and_then(Json::as_f64).unwrap_or(default);
    let orig = r
        .get("original_max_position_embeddings")
        .and_then(Json::as_u64)
        .ok_or_else(|| {
            cfg_err(
                "rope_parameters.original_max_position_embeddings",
                "yarn needs it",
            )
        })?;
    // transformers treats 0 and null alike for these.
    let opt = |k: &str| r.get(k).and_then(Json::as_f64).filter(|&v| v != 0.0);
    Ok(Some(Yarn {
        factor: num("factor", 1.0),
        original_max_position_embeddings: orig,
        attention_factor: opt("attention_factor"),
        mscale: opt("mscale"),
        mscale_all_dim: opt("mscale_all_dim"),
        beta_fast: opt("beta_fast").unwrap_or(32.0),
        beta_slow: opt("beta_slow").unwrap_or(1.0),
        truncate: r.get("truncate").and_then(Json::as_bool).unwrap_or(true),
    }))
}

type NumGetter<'a, T> = dyn Fn(&str) -> Result<Option<T>, ConfigError> + 'a;

fn gguf_yarn(f: &NumGetter<f64>, u: &NumGetter<u64>) -> Result<Option<Yarn>, ConfigError> {
    let Some(factor) = f("rope.scaling.factor")? else {
        return Ok(None);
    };
    // llama.cpp's converter stores 0.1·mscale_all_dim as the yarn log multiplier and no mscale;
    // DeepSeek's checkpoints set both equal, which leaves cos/sin unscaled.
    let mscale_all_dim = f("rope.scaling.yarn_log_multiplier")?
        .map(|m| m / 0.1)
        .filter(|&m| m != 0.0);
    Ok(Some(Yarn {
        factor,
        original_max_position_embeddings: u("rope.scaling.original_context_length")?.unwrap_or(0),
        attention_factor: None,
        mscale: mscale_all_dim,
        mscale_all_dim,
        beta_fast: f("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
        beta_slow: f("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
        truncate: true,
    }))
}

/// transformers' rule: explicit `indexer_types`, else `index_topk_pattern` ("FFS…"), else
/// layer i is full iff `max(i − offset + 1, 0) % freq == 0` (defaults freq 1, offset 2).
fn hf_indexer_types(j: &Json, layers: u64) -> Result<Vec<IndexerKind>, ConfigError> {
    let parse_kind = |s: &str| match s {
        "full" | "F" => Ok(IndexerKind::Full),
        "shared" | "S" => Ok(IndexerKind::Shared),
        other => Err(cfg_err(
            "indexer_types",
            format!("`{other}` is neither full nor shared"),
        )),
    };
    if let Some(list) = j.get("indexer_types").and_then(Json::as_array) {
        return list
            .iter()
            .map(|v| parse_kind(v.as_str().unwrap_or("?")))
            .collect();
    }
    if let Some(p) = j.get("index_topk_pattern").and_then(Json::as_str) {
        return p.chars().map(|c| parse_kind(&c.to_string())).collect();
    }
    let freq = j
        .get("index_topk_freq")
        .and_then(Json::as_u64)
        .unwrap_or(1)
        .max(1);
    let offset = j
        .get("index_skip_topk_offset")
        .and_then(Json::as_u64)
        .unwrap_or(2);
    Ok((0..layers)
        .map(|i| {
            if ((i + 1).saturating_sub(offset)) % freq == 0 {
                IndexerKind::Full
            } else {
                IndexerKind::Shared
            }
        })
        .collect())
}
