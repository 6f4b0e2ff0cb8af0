//! A GGUF's `ARCH.*` metadata as a family config, read the way llama.cpp's loader reads it:
//! its defaults for the keys a file leaves out.

use super::config::{
    cfg_err, glm_5_2_indexer_types, yarn_mscale, ConfigError, Glm5Config, IndexerKind, Member,
    TopkMethod, Yarn,
};
use super::family::llama_cpp_default_gating;
use crate::weights::gguf::{GgufModel, Value};

impl Glm5Config {
    /// Read the `ARCH.*` metadata a llama.cpp conversion writes (`glm-dsa`, `deepseek2`,
    /// `deepseek32`), with llama.cpp's loader defaults for the keys a file leaves out.
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
        // A legacy deepseek2 file (whole `attn_kv_b`, written before MLA absorption) has no
        // `*_mla` keys: its per-head sizes are `key_length`/`value_length`, which llama.cpp's
        // `n_embd_head_k_mla()`/`n_embd_head_v_mla()` fall back to.
        let key_mla = match u("attention.key_length_mla")? {
            Some(k) => k,
            None => u("attention.key_length")?.unwrap_or(d.qk_head_dim()),
        };
        let value_mla = match u("attention.value_length_mla")? {
            Some(v) => v,
            None => u("attention.value_length")?.unwrap_or(d.v_head_dim),
        };
        let vocab = match u("vocab_size")? {
            Some(v) => v,
            None => model
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(|a| a.len() as u64)
                .unwrap_or(0),
        };
        let scoring = match u("expert_gating_func")? {
            None => llama_cpp_default_gating(&arch, layers, vocab),
            Some(2) => "sigmoid",
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
        let pre = model.get("tokenizer.ggml.pre").and_then(Value::as_str);
        let name = model.get("general.name").and_then(Value::as_str);
        let member =
            Member::from_gguf(&arch, pre, name, scoring == "softmax").ok_or_else(|| {
                cfg_err(
                    "general.architecture",
                    format!("`{arch}` is not glm-dsa, deepseek2 or deepseek32"),
                )
            })?;
        let n_group = u("expert_group_count")?.unwrap_or(1);
        // llama.cpp chooses with the correction bias wherever the file holds `exp_probs_b`,
        // whatever the gating (a V3 file whose gating key went missing runs softmax with it), and
        // then ranks groups by their two best scores (noaux_tc). Without a bias it is
        // DeepSeek-V2's router: groups ranked by their best score, as DeepSeek's reference and
        // transformers do (llama.cpp sums the two best there too: a difference of llama.cpp's,
        // which the reference does not copy).
        let has_bias = model
            .tensors
            .iter()
            .any(|t| t.name.contains(".exp_probs_b."));
        let topk_method = match (scoring, has_bias, n_group) {
            ("sigmoid", _, _) | (_, true, _) => TopkMethod::NoauxTc,
            (_, false, 1) => TopkMethod::Greedy,
            _ => TopkMethod::GroupLimitedGreedy,
        };
        let cfg = Glm5Config {
            member,
            vocab_size: vocab,
            hidden_size: req("embedding_length")?,
            intermediate_size: u("feed_forward_length")?.unwrap_or(0),
            moe_intermediate_size: u("expert_feed_forward_length")?.unwrap_or(0),
            num_hidden_layers: layers,
            num_nextn_predict_layers: nextn,
            num_attention_heads: req("attention.head_count")?,
            q_lora_rank: u("attention.q_lora_rank")?.unwrap_or(0),
            kv_lora_rank: req("attention.kv_lora_rank")?,
            qk_nope_head_dim: key_mla.checked_sub(rope).ok_or_else(|| {
                cfg_err(
                    &key("attention.key_length_mla"),
                    format!("{key_mla} is smaller than the rope dims {rope}"),
                )
            })?,
            qk_rope_head_dim: rope,
            v_head_dim: value_mla,
            n_routed_experts: u("expert_count")?.unwrap_or(0),
            n_shared_experts: u("expert_shared_count")?.unwrap_or(0),
            num_experts_per_tok: u("expert_used_count")?.unwrap_or(0),
            first_k_dense_replace: u("leading_dense_block_count")?.unwrap_or(0),
            n_group,
            topk_group: u("expert_group_used_count")?.unwrap_or(1),
            routed_scaling_factor: f("expert_weights_scale")?.unwrap_or(1.0),
            norm_topk_prob: get("expert_weights_norm")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            scoring_func: scoring.into(),
            topk_method,
            rms_norm_eps: f("attention.layer_norm_rms_epsilon")?.unwrap_or(d.rms_norm_eps),
            rope_theta: f("rope.freq_base")?.unwrap_or(10000.0),
            // llama.cpp runs its MLA archs with NORM (adjacent-pair) RoPE; glm-dsa's indexer too,
            // DeepSeek-V3.2's rotates NeoX halves as DeepSeek's reference does.
            rope_interleave: true,
            indexer_rope_interleave: member != Member::DeepseekV32,
            yarn: gguf_yarn(&arch, &f, &u)?,
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
}

type NumGetter<'a, T> = dyn Fn(&str) -> Result<Option<T>, ConfigError> + 'a;

fn gguf_yarn(
    arch: &str,
    f: &NumGetter<f64>,
    u: &NumGetter<u64>,
) -> Result<Option<Yarn>, ConfigError> {
    let Some(factor) = f("rope.scaling.factor")? else {
        return Ok(None);
    };
    let mut yarn = llama_cpp_yarn(arch, factor, f("rope.scaling.yarn_log_multiplier")?);
    yarn.original_max_position_embeddings = u("rope.scaling.original_context_length")?.unwrap_or(0);
    yarn.beta_fast = f("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0);
    yarn.beta_slow = f("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0);
    Ok(Some(yarn))
}

/// YaRN by `factor` as llama.cpp's graph for `arch` runs it from
/// `rope.scaling.yarn_log_multiplier` (its converter writes 0.1·mscale_all_dim), in transformers'
/// terms. Absent or 0 (and always for glm-dsa, whose loader never reads the key), llama.cpp
/// scales cos/sin by YaRN's own mscale (0.1·ln(factor) + 1) and the softmax by its square. Given
/// mscale_all_dim m, it takes mscale = m on deepseek2 (cos/sin unscaled, the softmax × m's
/// mscale², DeepSeek's own YaRN) but mscale = 1 on the other archs: cos/sin × mscale(1)/mscale(m)
/// and, its kq scale squaring that ratio too, the softmax × mscale(1)². The two agree where
/// m = 1, as in DeepSeek-V3's and V3.2's configs. The original context and betas are the
/// caller's to fill.
pub fn llama_cpp_yarn(arch: &str, factor: f64, log_multiplier: Option<f64>) -> Yarn {
    let mscale_all_dim = log_multiplier
        .filter(|_| arch != "glm-dsa")
        .map(|m| m / 0.1)
        .filter(|&m| m != 0.0);
    let (attention_factor, mscale, mscale_all_dim) = match mscale_all_dim {
        None => (Some(yarn_mscale(factor, 1.0)), None, 1.0),
        Some(m) if arch == "deepseek2" || m == 1.0 => (None, Some(m), m),
        Some(m) => (
            Some(yarn_mscale(factor, 1.0) / yarn_mscale(factor, m)),
            Some(1.0),
            1.0,
        ),
    };
    Yarn {
        factor,
        original_max_position_embeddings: 0,
        attention_factor,
        mscale,
        mscale_all_dim: Some(mscale_all_dim),
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
    }
}
