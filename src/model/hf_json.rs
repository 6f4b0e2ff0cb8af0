//! Reading a member's `config.json`: its fields with their types checked, its rotary scaling,
//! its dense-then-sparse layers and indexer schedule, and the switches glmcheck refuses.

use serde_json::Value as Json;

use super::config::{cfg_err, ConfigError, IndexerKind, Yarn};

/// `j[key]` converted by `conv`, `default` when absent or null, an error naming the key otherwise.
pub(super) fn json_field<T>(
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

pub(super) fn yarn_from_json(r: &Json) -> Result<Option<Yarn>, ConfigError> {
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
pub(super) fn refuse_unrun_switches(j: &Json) -> Result<(), ConfigError> {
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

pub(super) fn leading_dense_layers(j: &Json, layers: u64) -> Result<Option<u64>, ConfigError> {
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
pub(super) fn hf_indexer_types(j: &Json, layers: u64) -> Result<Vec<IndexerKind>, ConfigError> {
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
