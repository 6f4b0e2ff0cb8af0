//! Reading a member's `config.json` as its transformers class runs it: its fields with their
//! types checked, its rotary scaling, its dense-then-sparse layers and indexer schedule, and the
//! switches glmcheck refuses.

use serde_json::Value as Json;

use super::config::{
    cfg_err, ConfigError, Glm5Config, IndexerKind, Member, TopkMethod, Yarn, HF_MODEL_TYPES,
};

impl Glm5Config {
    /// Parse a Hugging Face `config.json` of any member, read as its transformers class runs
    /// it: DeepSeek-V2 always softmax-scores and rotates interleaved pairs and never
    /// renormalizes its top-k weights; every class but V2's routes with `noaux_tc`; only GLM-5
    /// and DeepSeek-V3.2 have the DSA indexer, V3.2's rotating NeoX halves on every layer.
    pub fn from_hf_json(text: &str) -> Result<Self, ConfigError> {
        let j: Json = serde_json::from_str(text).map_err(|e| cfg_err("(json)", e.to_string()))?;
        let model_type = j
            .get("model_type")
            .and_then(Json::as_str)
            .unwrap_or("glm_moe_dsa");
        let member = Member::from_model_type(model_type).ok_or_else(|| {
            cfg_err(
                "model_type",
                format!("`{model_type}` is none of {}", HF_MODEL_TYPES.join(", ")),
            )
        })?;
        refuse_unrun_switches(&j)?;
        let mut cfg = Self::from_family_json(&j, member)?;
        if !member.has_indexer() {
            cfg = cfg.without_indexer();
        }
        match member {
            Member::DeepseekV2 => {
                cfg.rope_interleave = true;
                cfg.norm_topk_prob = false;
                cfg.topk_method = match j.get("topk_method").and_then(Json::as_str) {
                    None => TopkMethod::Greedy,
                    Some(m) => TopkMethod::parse(m)
                        .filter(|m| !m.has_bias())
                        .ok_or_else(|| {
                            cfg_err(
                                "topk_method",
                                format!(
                                    "`{m}`: DeepseekV2 routes `greedy` or `group_limited_greedy`"
                                ),
                            )
                        })?,
                };
                cfg.scoring_func = "softmax".into();
                if cfg.topk_method == TopkMethod::Greedy {
                    // Greedy routing never reads the groups.
                    (cfg.n_group, cfg.topk_group) = (1, 1);
                }
            }
            Member::DeepseekV32 => {
                // Its class turns MLA's interleaved pairs whatever `rope_interleave` says.
                cfg.rope_interleave = true;
                cfg.indexer_rope_interleave = false;
                cfg.indexer_types = vec![IndexerKind::Full; cfg.num_hidden_layers as usize];
            }
            Member::Glm5 | Member::DeepseekV3 | Member::KimiK2 | Member::Glm47Flash => {}
        }
        if member != Member::DeepseekV2 {
            // Every class but V2's scores with sigmoid whatever `scoring_func` says.
            cfg.scoring_func = "sigmoid".into();
        }
        if matches!(member, Member::Glm47Flash | Member::DeepseekV32) {
            // These classes build each layer's MLP from `mlp_layer_types`.
            cfg.first_k_dense_replace = leading_dense_layers(&j, cfg.num_hidden_layers)?
                .unwrap_or(cfg.first_k_dense_replace);
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// The fields of a member's config.json, its config class's defaults where absent.
    fn from_family_json(j: &Json, member: Member) -> Result<Self, ConfigError> {
        let d = Self::hf_defaults(member);
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
        // `"q_lora_rank": null` is how V2-Lite says it has none; only a missing key takes the
        // class default.
        let q_lora_rank = match j.get("q_lora_rank") {
            Some(Json::Null) => 0,
            _ => u("q_lora_rank", d.q_lora_rank)?,
        };
        Ok(Glm5Config {
            member,
            vocab_size: u("vocab_size", d.vocab_size)?,
            hidden_size: u("hidden_size", d.hidden_size)?,
            intermediate_size: u("intermediate_size", d.intermediate_size)?,
            moe_intermediate_size: u("moe_intermediate_size", d.moe_intermediate_size)?,
            num_hidden_layers: layers,
            num_nextn_predict_layers: u("num_nextn_predict_layers", 0)?,
            num_attention_heads: u("num_attention_heads", d.num_attention_heads)?,
            q_lora_rank,
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
                .unwrap_or(&d.scoring_func)
                .to_string(),
            topk_method: d.topk_method,
            rms_norm_eps: f("rms_norm_eps", d.rms_norm_eps)?,
            rope_theta,
            rope_interleave: b("rope_interleave", true)?,
            indexer_rope_interleave: b("indexer_rope_interleave", d.indexer_rope_interleave)?,
            yarn: rope.map(yarn_from_json).transpose()?.flatten(),
            index_n_heads: u("index_n_heads", d.index_n_heads)?,
            index_head_dim: u("index_head_dim", d.index_head_dim)?,
            index_topk: u("index_topk", d.index_topk)?,
            indexer_types: hf_indexer_types(j, layers)?,
            max_position_embeddings: u("max_position_embeddings", d.max_position_embeddings)?,
            tie_word_embeddings: b("tie_word_embeddings", false)?,
        })
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
    match ty {
        // vLLM's DeepSeek attention renames its config's `yarn` in place (`deepseek_llama_scaling`
        // where `attention_factor` is 1), so a vLLM trace records its name for the same values.
        "yarn" | "deepseek_yarn" | "deepseek_llama_scaling" => {}
        "default" => return Ok(None),
        other => {
            return Err(cfg_err(
                "rope_parameters.rope_type",
                format!("`{other}` is not a rotary scaling the family runs (default, yarn)"),
            ))
        }
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

/// GLM-4.7-Flash's `mlp_layer_types` ("dense"/"sparse" per layer) as the number of leading
/// dense layers; the forward runs only dense-then-sparse schedules.
/// A config.json switch the family's checkpoints never turn on and glmcheck does not run
/// (biases on the attention's or the MLPs' projections, another activation) is refused, not
/// silently run another way than the checkpoint's class runs it.
fn refuse_unrun_switches(j: &Json) -> Result<(), ConfigError> {
    for key in ["attention_bias", "mlp_bias"] {
        if j.get(key).and_then(Json::as_bool) == Some(true) {
            return Err(cfg_err(
                key,
                "true: glmcheck runs the family without biases",
            ));
        }
    }
    match j.get("hidden_act").and_then(Json::as_str) {
        Some(act) if act != "silu" => Err(cfg_err(
            "hidden_act",
            format!("`{act}`: glmcheck runs the family's MLPs with silu"),
        )),
        _ => Ok(()),
    }
}

fn leading_dense_layers(j: &Json, layers: u64) -> Result<Option<u64>, ConfigError> {
    let Some(kinds) = j.get("mlp_layer_types").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kinds: Vec<&str> = kinds
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap_or("?")).collect())
        .unwrap_or_default();
    let dense = kinds.iter().take_while(|&&k| k == "dense").count();
    if kinds.len() as u64 != layers || kinds[dense..].iter().any(|&k| k != "sparse") {
        return Err(cfg_err(
            "mlp_layer_types",
            format!("{kinds:?} is not {layers} layers of \"dense\" followed by \"sparse\""),
        ));
    }
    Ok(Some(dense as u64))
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
