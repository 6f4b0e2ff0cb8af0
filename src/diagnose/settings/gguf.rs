//! A GGUF's metadata as llama.cpp's loader for its arch reads it (its defaults where a key is
//! absent), against the reference's config.

use serde_json::{Map, Value};

use super::{Mismatch, KEYS};
use crate::exec::ops::rope::yarn_attention_factor;
use crate::model::config::{glm_5_2_indexer_types, IndexerKind};
use crate::model::family::llama_cpp_default_gating;
use crate::model::gguf_config::llama_cpp_yarn;
use crate::model::Glm5Config;

/// The recorded GGUF metadata of an engine trace, if it has any.
pub(super) fn metadata(config: &Value) -> Option<&Map<String, Value>> {
    config
        .as_object()
        .filter(|m| m.get("general.architecture").is_some_and(Value::is_string))
}

/// f32 metadata against an f64 config value: equal up to f32 rounding.
pub(super) fn differs(a: f64, b: f64) -> bool {
    (a - b).abs() > 1e-6 * a.abs().max(b.abs())
}

pub(super) fn gguf_mismatches(meta: &Map<String, Value>, cfg: &Glm5Config) -> Vec<Mismatch> {
    let arch = meta["general.architecture"].as_str().unwrap_or_default();
    let get = |k: &str| meta.get(&format!("{arch}.{k}"));
    let num = |k: &str| get(k).and_then(Value::as_f64);
    let count = |k: &str| get(k).and_then(Value::as_u64);
    let mut out = Vec::new();
    let mut add = |key: &str, found: String| {
        let spec = KEYS
            .iter()
            .find(|k| k.key == Some(key))
            .expect("a key of KEYS");
        out.push(Mismatch {
            key: format!("{arch}.{key}"),
            found,
            spec,
        })
    };

    // llama.cpp fixes glm-dsa's rotary style (adjacent pairs) by architecture; what metadata
    // changes is the scaling type, its factor (positions × 1/factor; never applied under
    // `none`) and the base.
    let scaling = get("rope.scaling.type")
        .and_then(Value::as_str)
        .unwrap_or("linear");
    let factor = num("rope.scaling.factor")
        .or_else(|| num("rope.scale_linear"))
        .filter(|f| *f != 0.0)
        .unwrap_or(1.0);
    let scaling_found = match (&cfg.yarn, scaling) {
        (None, "yarn") => Some("yarn, where the reference has no rope_scaling".to_string()),
        (None, s) if s != "none" && differs(factor, 1.0) => Some(format!(
            "{scaling} with factor {factor}, where the reference has no rope_scaling"
        )),
        (Some(_), s) if s != "yarn" => Some(format!("{s}, where the reference has YaRN")),
        (Some(y), _) => {
            // Absent: the training context, as llama.cpp's loader reads it.
            let original = count("rope.scaling.original_context_length")
                .or_else(|| count("context_length"))
                .unwrap_or(0);
            (differs(factor, y.factor) || original != y.original_max_position_embeddings).then(
                || {
                    format!(
                        "yarn with factor {factor} over an original context of {original}, \
                         where the reference's rope_scaling has factor {} over {}",
                        y.factor, y.original_max_position_embeddings
                    )
                },
            )
        }
        _ => None,
    };
    if let Some(found) = scaling_found {
        add("rope.scaling.type", found);
    } else if let (Some(y), "yarn") = (&cfg.yarn, scaling) {
        // The same scaling's magnitudes: what llama.cpp makes of the log multiplier (absent or
        // 0, YaRN's own mscale on cos/sin and its square on the softmax).
        let log_multiplier = num("rope.scaling.yarn_log_multiplier");
        let theirs = llama_cpp_yarn(arch, factor, log_multiplier);
        let (cos_sin, softmax) = (yarn_attention_factor(&theirs), theirs.softmax_factor());
        let (ours_cos_sin, ours_softmax) = (yarn_attention_factor(y), y.softmax_factor());
        if differs(cos_sin, ours_cos_sin) || differs(softmax, ours_softmax) {
            let value = match log_multiplier {
                Some(m) => format!("{m}"),
                None => "absent".into(),
            };
            let found = format!(
                "{value} (llama.cpp: cos/sin × {cos_sin:.4}, softmax scale × {softmax:.4}), \
                 where the reference's YaRN gives cos/sin × {ours_cos_sin:.4} and softmax scale \
                 × {ours_softmax:.4}"
            );
            add("rope.scaling.yarn_log_multiplier", found);
        }
    }
    let base = num("rope.freq_base").unwrap_or(10000.0);
    if differs(base, cfg.rope_theta) {
        let found = format!(
            "{base}, where the reference's rope_theta is {}",
            cfg.rope_theta
        );
        add("rope.freq_base", found);
    }
    if let Some(eps) = num("attention.layer_norm_rms_epsilon") {
        if differs(eps, cfg.rms_norm_eps) {
            let found = format!(
                "{eps:e}, where the reference's rms_norm_eps is {:e}",
                cfg.rms_norm_eps
            );
            add("attention.layer_norm_rms_epsilon", found);
        }
    }
    // llama.cpp scales the routing weights only by a scale that is set and not 1.
    let scale = num("expert_weights_scale")
        .filter(|s| *s != 0.0)
        .unwrap_or(1.0);
    if differs(scale, cfg.routed_scaling_factor) {
        let found = format!(
            "{scale}, where the reference's routed_scaling_factor is {}",
            cfg.routed_scaling_factor
        );
        add("expert_weights_scale", found);
    }
    let norm = get("expert_weights_norm")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if norm != cfg.norm_topk_prob {
        let found = format!(
            "{norm} (absent reads as false), where the reference's norm_topk_prob is {}",
            cfg.norm_topk_prob
        );
        add("expert_weights_norm", found);
    }
    // Absent: 1; it scales cos and sin and, squared, the softmax. YaRN's own factor is
    // another matter (the reference's mscales), left to `rope.scaling.type`.
    let attn_factor = num("rope.scaling.attn_factor").unwrap_or(1.0);
    if cfg.yarn.is_none() && differs(attn_factor, 1.0) {
        let found = format!("{attn_factor}, where the reference has no rope_scaling (1)");
        add("rope.scaling.attn_factor", found);
    }
    // Required by llama.cpp's loader: a trace exists only where the file has them.
    if let Some(k) = count("attention.indexer.top_k") {
        if cfg.has_dsa() && k != cfg.index_topk {
            let found = format!(
                "{k}, where the reference's index_topk is {}",
                cfg.index_topk
            );
            add("attention.indexer.top_k", found);
        }
    }
    if cfg.has_dsa() {
        let layers = cfg.num_hidden_layers as usize;
        let theirs = indexer_types_read(
            get("attention.indexer.types"),
            count("context_length").unwrap_or(0),
            layers,
        );
        let ours: Vec<IndexerKind> = (0..layers as u64)
            .map(|l| match cfg.has_indexer(l) {
                true => IndexerKind::Full,
                false => IndexerKind::Shared,
            })
            .collect();
        if theirs != ours {
            let bits = |t: &[IndexerKind]| -> String {
                t.iter()
                    .map(|k| if *k == IndexerKind::Full { '1' } else { '0' })
                    .collect()
            };
            let found = format!(
                "{} (1: a layer's own top-k), where the reference's indexer_types are {}",
                bits(&theirs),
                bits(&ours)
            );
            add("attention.indexer.types", found);
        }
    }
    if let Some(k) = count("expert_used_count") {
        if cfg.n_routed_experts > 0 && k != cfg.num_experts_per_tok {
            let found = format!(
                "{k}, where the reference's num_experts_per_tok is {}",
                cfg.num_experts_per_tok
            );
            add("expert_used_count", found);
        }
    }
    // Absent: 0. llama.cpp limits groups only with more than one; so does the reference, and
    // choosing all groups limits nothing.
    let limit = |groups: u64, used: u64| (groups > 1 && used < groups).then_some((groups, used));
    let theirs = limit(
        count("expert_group_count").unwrap_or(0),
        count("expert_group_used_count").unwrap_or(0),
    );
    let ours = limit(cfg.n_group, cfg.topk_group);
    if cfg.n_routed_experts > 0 && theirs != ours {
        let said = |g: Option<(u64, u64)>| match g {
            Some((g, u)) => format!("the best {u} of {g} groups"),
            None => "no group limit".to_string(),
        };
        let found = format!(
            "{} / expert_group_used_count {} ({}), where the reference's n_group / topk_group \
             are {} / {} ({})",
            count("expert_group_count").unwrap_or(0),
            count("expert_group_used_count").unwrap_or(0),
            said(theirs),
            cfg.n_group,
            cfg.topk_group,
            said(ours)
        );
        add("expert_group_count", found);
    }
    // 1 softmax, 2 sigmoid, 3 softmax over the chosen; absent or 0 as the arch's loader
    // defaults it (deepseek2: softmax, but for GLM-4.7-Flash's shape).
    let layers = count("block_count")
        .unwrap_or(0)
        .saturating_sub(count("nextn_predict_layers").unwrap_or(0));
    let default =
        llama_cpp_default_gating(arch, layers, count("vocab_size").unwrap_or(cfg.vocab_size));
    let gating = match get("expert_gating_func").and_then(Value::as_u64) {
        None | Some(0) => default,
        Some(2) => "sigmoid",
        Some(1) => "softmax",
        Some(3) => "softmax_weight",
        Some(_) => "unknown",
    };
    if gating != cfg.scoring_func {
        let found = format!(
            "{gating}, where the reference's scoring_func is {}",
            cfg.scoring_func
        );
        add("expert_gating_func", found);
    }
    out
}

/// The layers' indexer types as llama.cpp's glm-dsa loader reads them: the key's array (or one
/// value for every layer), else by the training context, GLM-5 and 5.1 (below 1048576) full
/// everywhere, GLM-5.2's pattern above.
fn indexer_types_read(key: Option<&Value>, context: u64, layers: usize) -> Vec<IndexerKind> {
    let kind = |v: &Value| match v.as_bool().or_else(|| v.as_i64().map(|n| n != 0)) {
        Some(false) => IndexerKind::Shared,
        _ => IndexerKind::Full,
    };
    match key {
        Some(Value::Array(items)) => items.iter().take(layers).map(kind).collect(),
        Some(v) => vec![kind(v); layers],
        None if context < 1 << 20 => vec![IndexerKind::Full; layers],
        None => glm_5_2_indexer_types(layers),
    }
}
