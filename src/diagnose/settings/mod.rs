//! The settings an engine ran with that change its numbers without changing a shape, against
//! the reference's config: the GGUF metadata llama.cpp read (the llama.cpp probe records the
//! file's metadata in `model.config`), taken with the defaults llama.cpp's loader applies when a
//! key is absent, or the `config.json` a vLLM or transformers run took (their probes record it
//! there). A mismatch that changes the first divergent stage, or a stage hidden behind it, is
//! the cause, classified by what the setting does.

mod gguf;
mod keys;

use serde_json::{Map, Value};

use crate::compare::diff::Divergence;
use crate::compare::{DiffReport, Fault, Status};
use crate::exec::ops::rope::yarn_attention_factor;
use crate::model::config::HF_MODEL_TYPES;
use crate::model::stage::kind_of;
use crate::model::Glm5Config;
use crate::trace::ModelInfo;
use gguf::{differs, gguf_mismatches, metadata};
pub use keys::{Key, KEYS, OTHER_KEYS};

/// One setting whose value the engine runs with differs from the reference's.
pub(super) struct Mismatch {
    /// The GGUF key (with its arch prefix) or the config field.
    key: String,
    /// What the engine runs with and what the reference has, in words.
    found: String,
    spec: &'static Key,
}

/// The settings an engine trace records (`model.config`): the GGUF metadata llama.cpp read, or
/// the `config.json` of a vLLM or transformers run. glmcheck's own traces record the parsed
/// config, which is the reference's own reading and is not compared.
pub enum Settings<'a> {
    Gguf(&'a Map<String, Value>),
    Config(Box<Glm5Config>),
}

impl<'a> Settings<'a> {
    /// What the trace records, if it records an engine's settings; a `config.json` that does
    /// not parse is an error naming the field.
    pub fn of(info: &'a ModelInfo) -> anyhow::Result<Option<Settings<'a>>> {
        if let Some(meta) = metadata(&info.config) {
            return Ok(Some(Settings::Gguf(meta)));
        }
        let model_type = info.config.get("model_type").and_then(Value::as_str);
        if !model_type.is_some_and(|t| HF_MODEL_TYPES.contains(&t)) {
            return Ok(None);
        }
        let cfg = Glm5Config::from_hf_json(&info.config.to_string())
            .map_err(|e| anyhow::anyhow!("the trace's model.config: {e}"))?;
        Ok(Some(Settings::Config(Box::new(cfg))))
    }

    /// How the report names where a value came from.
    fn origin(&self) -> &'static str {
        match self {
            Settings::Gguf(_) => "GGUF metadata",
            Settings::Config(_) => "the engine's config",
        }
    }

    /// How the engine read it, for the evidence.
    fn read_as(&self) -> &'static str {
        match self {
            Settings::Gguf(_) => "what llama.cpp read (absent keys as its loader defaults them)",
            Settings::Config(_) => "what the engine's model took from its config.json",
        }
    }

    /// The name a key goes by in these settings: the GGUF key with its arch prefix, or the
    /// config field; `None` for a key these settings cannot hold.
    fn name(&self, key: &Key) -> Option<String> {
        match self {
            Settings::Gguf(meta) => {
                let arch = meta.get("general.architecture")?.as_str()?;
                Some(format!("{arch}.{}", key.key?))
            }
            Settings::Config(_) => Some(
                key.fields
                    .iter()
                    .map(|f| config_name(f))
                    .collect::<Vec<_>>()
                    .join("/"),
            ),
        }
    }

    fn mismatches(&self, cfg: &Glm5Config) -> Vec<Mismatch> {
        match self {
            Settings::Gguf(meta) => gguf_mismatches(meta, cfg),
            Settings::Config(theirs) => config_mismatches(theirs, cfg),
        }
    }
}

/// A config field as `config.json` names it (YaRN is its `rope_scaling`).
pub fn config_name(field: &str) -> &str {
    match field {
        "yarn" => "rope_scaling",
        f => f,
    }
}

/// A config as compared: its fields, YaRN as what the forward takes from it (one config may
/// spell the same scaling with `attention_factor`, another with equal mscales).
fn compared_fields(cfg: &Glm5Config) -> Map<String, Value> {
    let Ok(Value::Object(mut fields)) = serde_json::to_value(cfg) else {
        return Map::new();
    };
    let yarn = cfg.yarn.as_ref().map(|y| {
        serde_json::json!({
            "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "cos_sin_scale": yarn_attention_factor(y),
            "softmax_scale": cfg.yarn_softmax_factor(),
            "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow,
            "truncate": y.truncate,
        })
    });
    fields.insert("yarn".into(), yarn.unwrap_or(Value::Null));
    fields
}

/// Two compared values the same: numbers up to f32 rounding, objects field by field.
fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| same_value(v, w)))
        }
        _ => match (a.as_f64(), b.as_f64()) {
            (Some(x), Some(y)) => !differs(x, y),
            _ => a == b,
        },
    }
}

/// The fields of [`KEYS`], once each, where the engine's config differs from the reference's.
fn config_mismatches(theirs: &Glm5Config, ours: &Glm5Config) -> Vec<Mismatch> {
    let (t, o) = (compared_fields(theirs), compared_fields(ours));
    let mut out: Vec<Mismatch> = Vec::new();
    for spec in &KEYS {
        for &field in spec.fields {
            let key = config_name(field).to_string();
            if out.iter().any(|m| m.key == key) {
                continue;
            }
            let (a, b) = (
                t.get(field).unwrap_or(&Value::Null),
                o.get(field).unwrap_or(&Value::Null),
            );
            if !same_value(a, b) {
                let found = format!(
                    "{}, where the reference's is {}",
                    shown(a, field),
                    shown(b, field)
                );
                out.push(Mismatch { key, found, spec });
            }
        }
    }
    out
}

/// A config value in words: `none` for an absent rope scaling.
fn shown(v: &Value, field: &str) -> String {
    match (v, field) {
        (Value::Null, "yarn") => "none".to_string(),
        _ => v.to_string(),
    }
}

/// The stage without its layer prefix.
fn kind(stage: &str) -> &str {
    kind_of(stage).unwrap_or(stage)
}

/// The keys of [`KEYS`] (as `settings` name them) that change one of `stages`, for the report
/// of what was compared on a divergence's path; none without settings.
pub fn keys_on(settings: Option<&Settings>, stages: &[String]) -> Vec<String> {
    let Some(settings) = settings else {
        return Vec::new();
    };
    let mut out: Vec<String> = Vec::new();
    for k in KEYS
        .iter()
        .filter(|k| stages.iter().any(|s| k.stages.contains(&kind(s))))
    {
        if let Some(name) = settings.name(k).filter(|n| !out.contains(n)) {
            out.push(name);
        }
    }
    out
}

/// Name the settings mismatch that changes the first divergent stage or a stage the trace does
/// not hold behind it (`path`: those stages and the divergent one), if one does; every other
/// mismatch is listed as evidence. Where every stage passed, a mismatch still fails the run, at
/// the first stage it changes (as the weight check does). Returns whether the settings decided
/// the class.
pub fn explain(
    settings: &Settings,
    cfg: &Glm5Config,
    report: &mut DiffReport,
    path: &[String],
) -> bool {
    let found = settings.mismatches(cfg);
    let origin = settings.origin();
    let inside = report.first_divergence.is_none();
    let (stage, cause) = match &report.first_divergence {
        Some(d) => match found
            .iter()
            .find(|m| path.iter().any(|s| m.spec.stages.contains(&kind(s))))
        {
            Some(m) => (d.stage.clone(), m),
            None => {
                if let Some(f) = &mut report.fault {
                    for m in &found {
                        f.evidence.push(format!("{origin} {} = {}", m.key, m.found));
                    }
                }
                return false;
            }
        },
        // The first stage, in the reference's order, that some mismatch changes.
        None => {
            let first = report.stages.iter().find_map(|s| {
                let m = found
                    .iter()
                    .find(|m| m.spec.stages.contains(&kind(&s.stage)))?;
                Some((s, m))
            });
            let Some((s, m)) = first else {
                return false;
            };
            report.verdict = Status::Fail;
            report.first_divergence = Some(Divergence {
                stage: s.stage.clone(),
                layer: s.layer,
                rank: None,
            });
            (s.stage.clone(), m)
        }
    };
    let mut evidence = vec![format!("{} is {}", cause.key, settings.read_as())];
    let changed_hidden: Vec<&String> = path
        .iter()
        .filter(|s| **s != stage && cause.spec.stages.contains(&kind(s)))
        .collect();
    if !changed_hidden.is_empty() {
        evidence.push(format!(
            "it changes {} first, which the trace does not hold; {stage} is the first recorded \
             stage after it",
            changed_hidden
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    if inside {
        if let Some(s) = report.stages.iter().find(|s| s.stage == stage) {
            evidence.push(format!(
                "{stage}: rel_diff {:.3e}, inside its tolerance {:.3e}; the setting alone fails \
                 the run",
                s.rel_diff, s.tolerance
            ));
        }
    }
    if let Some(traced) = report.fault.take() {
        evidence.push(format!(
            "the traces alone: {} — {}",
            traced.class.name(),
            traced.summary
        ));
    }
    for m in found.iter().filter(|m| m.key != cause.key) {
        evidence.push(format!("also {origin} {} = {}", m.key, m.found));
    }
    report.fault = Some(Fault {
        class: cause.spec.class,
        summary: format!(
            "{origin} {} = {}: {} — first seen at {stage}",
            cause.key, cause.found, cause.spec.does
        ),
        evidence,
        weight: None,
    });
    true
}

#[cfg(test)]
mod tests {
    use super::keys::ROPE;
    use super::*;
    use crate::compare::FaultClass;
    use crate::model::config::{glm_5_2_indexer_types, IndexerKind};

    /// GLM-5's config as a converter writes it into `glm-dsa.*`, with `edit` applied.
    fn keys_found(edit: &[(&str, Option<Value>)]) -> Vec<&'static str> {
        let mut meta: Map<String, Value> = serde_json::from_value(serde_json::json!({
            "general.architecture": "glm-dsa",
            "glm-dsa.rope.freq_base": 1e6,
            "glm-dsa.attention.layer_norm_rms_epsilon": 1e-5,
            "glm-dsa.expert_weights_scale": 2.5,
            "glm-dsa.expert_weights_norm": true,
            "glm-dsa.expert_gating_func": 2,
            "glm-dsa.attention.indexer.top_k": 2048,
            "glm-dsa.expert_used_count": 8,
            "glm-dsa.expert_group_count": 1,
            "glm-dsa.expert_group_used_count": 1,
        }))
        .unwrap();
        for (k, v) in edit {
            match v {
                Some(v) => meta.insert(format!("glm-dsa.{k}"), v.clone()),
                None => meta.remove(&format!("glm-dsa.{k}")),
            };
        }
        gguf_mismatches(&meta, &Glm5Config::glm5())
            .iter()
            .map(|m| m.spec.key.expect("a GGUF key"))
            .collect()
    }

    #[test]
    fn absent_keys_read_as_llama_cpp_reads_them() {
        assert!(keys_found(&[]).is_empty());
        // No scale key: no scaling, not 2.5. No norm flag: false. No gating key: sigmoid.
        assert_eq!(
            keys_found(&[("expert_weights_scale", None)]),
            ["expert_weights_scale"]
        );
        assert_eq!(
            keys_found(&[("expert_weights_norm", None)]),
            ["expert_weights_norm"]
        );
        assert!(keys_found(&[("expert_gating_func", None)]).is_empty());
        assert_eq!(keys_found(&[("rope.freq_base", None)]), ["rope.freq_base"]);
    }

    /// llama.cpp's deepseek2 loader reads a missing gating key as softmax (V2's), except on
    /// GLM-4.7-Flash's shape: a GLM-4.7-Flash file converted before the key was written (its
    /// real bug) is named unless it has that shape; a DeepSeek-V2 file is fine without it.
    #[test]
    fn a_deepseek2_file_without_its_gating_key_runs_softmax_unless_shaped_as_glm_4_7_flash() {
        let flash = Glm5Config::from_hf_json(r#"{"model_type": "glm4_moe_lite"}"#).unwrap();
        let found = |blocks: u64, vocab: u64, cfg: &Glm5Config| -> Vec<&'static str> {
            let meta: Map<String, Value> = serde_json::from_value(serde_json::json!({
                "general.architecture": "deepseek2",
                "deepseek2.block_count": blocks,
                "deepseek2.vocab_size": vocab,
                "deepseek2.rope.freq_base": cfg.rope_theta,
                "deepseek2.attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
                "deepseek2.expert_weights_scale": cfg.routed_scaling_factor,
                "deepseek2.expert_weights_norm": cfg.norm_topk_prob,
                "deepseek2.expert_used_count": cfg.num_experts_per_tok,
            }))
            .unwrap();
            gguf_mismatches(&meta, cfg)
                .iter()
                .map(|m| m.spec.key.expect("a GGUF key"))
                .collect()
        };
        assert_eq!(found(48, 154880, &flash), Vec::<&str>::new());
        assert_eq!(found(4, 154880, &flash), ["expert_gating_func"]);
        let v2 =
            Glm5Config::from_hf_json(r#"{"model_type": "deepseek_v2", "num_experts_per_tok": 6}"#)
                .unwrap();
        assert_eq!(found(4, 154880, &v2), Vec::<&str>::new());
    }

    #[test]
    fn counts_and_group_limits_are_compared_as_llama_cpp_applies_them() {
        let set = |k: &'static str, v: u64| (k, Some(Value::from(v)));
        assert_eq!(
            keys_found(&[set("attention.indexer.top_k", 1024)]),
            ["attention.indexer.top_k"]
        );
        assert_eq!(
            keys_found(&[set("expert_used_count", 7)]),
            ["expert_used_count"]
        );
        // One group, or every group chosen, limits nothing; absent reads as 0.
        assert!(keys_found(&[
            ("expert_group_count", None),
            ("expert_group_used_count", None)
        ])
        .is_empty());
        assert!(keys_found(&[
            set("expert_group_count", 4),
            set("expert_group_used_count", 4)
        ])
        .is_empty());
        assert_eq!(
            keys_found(&[
                set("expert_group_count", 4),
                set("expert_group_used_count", 2)
            ]),
            ["expert_group_count"]
        );
        let attn = ("rope.scaling.attn_factor", Some(Value::from(1.5)));
        assert_eq!(keys_found(&[attn]), ["rope.scaling.attn_factor"]);
    }

    #[test]
    fn a_key_is_named_for_a_hidden_stage_on_the_path() {
        let meta: Map<String, Value> = serde_json::from_value(serde_json::json!({
            "general.architecture": "glm-dsa",
            "glm-dsa.expert_used_count": 3,
        }))
        .unwrap();
        let path = ["L1.moe.topk_ids".to_string(), "L1.ffn.out".to_string()];
        assert_eq!(
            keys_on(Some(&Settings::Gguf(&meta)), &path),
            [
                "glm-dsa.expert_used_count",
                "glm-dsa.expert_group_count",
                "glm-dsa.expert_gating_func"
            ]
        );
        assert!(keys_on(None, &path).is_empty());
    }

    #[test]
    fn rope_scaling_counts_only_where_llama_cpp_applies_it() {
        let factor = ("rope.scaling.factor", Some(Value::from(4.0)));
        let typed = |t: &str| ("rope.scaling.type", Some(Value::from(t)));
        assert_eq!(
            keys_found(std::slice::from_ref(&factor)),
            ["rope.scaling.type"]
        );
        assert_eq!(
            keys_found(&[typed("linear"), factor.clone()]),
            ["rope.scaling.type"]
        );
        assert!(keys_found(&[typed("none"), factor]).is_empty());
        assert_eq!(keys_found(&[typed("yarn")]), ["rope.scaling.type"]);
    }

    #[test]
    fn indexer_types_follow_llama_cpp_s_context_rule() {
        // GLM-5 runs every indexer: a 1M context without the key reads as GLM-5.2's pattern.
        let long = ("context_length", Some(Value::from(1u64 << 20)));
        assert_eq!(
            keys_found(std::slice::from_ref(&long)),
            ["attention.indexer.types"]
        );
        let all_full = Value::from(vec![1u64; 78]);
        assert!(keys_found(&[long, ("attention.indexer.types", Some(all_full))]).is_empty());
        let short = ("context_length", Some(Value::from(202752u64)));
        assert!(keys_found(&[short]).is_empty());
        let one_shared: Vec<u64> = (0..78).map(|l| u64::from(l != 5)).collect();
        let types = ("attention.indexer.types", Some(Value::from(one_shared)));
        assert_eq!(keys_found(&[types]), ["attention.indexer.types"]);
        let pattern = glm_5_2_indexer_types(12);
        let full: Vec<usize> = (0..12)
            .filter(|&l| pattern[l] == IndexerKind::Full)
            .collect();
        assert_eq!(full, [0, 1, 2, 6, 10]);
    }

    #[test]
    fn yarn_factor_and_original_context_are_compared_under_yarn() {
        let mut cfg = Glm5Config::glm5();
        cfg.yarn = Some(crate::model::config::Yarn::deepseek(40.0, 4096));
        let meta = |factor: f64, original: u64| -> Map<String, Value> {
            serde_json::from_value(serde_json::json!({
                "general.architecture": "glm-dsa",
                "glm-dsa.rope.freq_base": 1e6,
                "glm-dsa.rope.scaling.type": "yarn",
                "glm-dsa.rope.scaling.factor": factor,
                "glm-dsa.rope.scaling.original_context_length": original,
            }))
            .unwrap()
        };
        let rope = |m: &Map<String, Value>| -> Vec<String> {
            gguf_mismatches(m, &cfg)
                .into_iter()
                .filter(|m| m.spec.stages == ROPE)
                .map(|m| m.found)
                .collect()
        };
        assert!(rope(&meta(40.0, 4096)).is_empty());
        let found = rope(&meta(4.0, 4096));
        assert_eq!(found.len(), 1);
        assert!(
            found[0].contains("factor 4 over an original context of 4096"),
            "{found:?}"
        );
        assert_eq!(rope(&meta(40.0, 8192)).len(), 1);
    }

    #[test]
    fn an_engine_config_is_compared_field_by_field_with_the_reference() {
        let ours = Glm5Config::glm5();
        let mut theirs = ours.clone();
        assert!(config_mismatches(&theirs, &ours).is_empty());
        theirs.routed_scaling_factor = 1.0;
        theirs.rope_interleave = false;
        // Shapes are the load's to check, not this comparison's.
        theirs.hidden_size += 1;
        let found = config_mismatches(&theirs, &ours);
        let named: Vec<(&str, &str)> = found
            .iter()
            .map(|m| (m.key.as_str(), m.found.as_str()))
            .collect();
        assert_eq!(
            named,
            [
                ("routed_scaling_factor", "1.0, where the reference's is 2.5"),
                ("rope_interleave", "false, where the reference's is true"),
            ]
        );
        assert_eq!(found[0].spec.class, FaultClass::ScaleMismatch);
        // Both fields of the group limit are compared.
        theirs = ours.clone();
        theirs.topk_group += 1;
        let found = config_mismatches(&theirs, &ours);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].key, "topk_group");
        assert_eq!(found[0].spec.class, FaultClass::RouterMismatch);
        theirs = ours.clone();
        theirs.yarn = Some(crate::model::config::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 4096,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
        });
        let found = config_mismatches(&theirs, &ours);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].key, "rope_scaling");
        assert!(found[0].found.ends_with("where the reference's is none"));
        // One YaRN spelled two ways (equal mscales, or the cos/sin scale they give written out)
        // is the same scaling; another factor is not.
        let yarn = |attention_factor, mscale| crate::model::config::Yarn {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            attention_factor,
            mscale,
            mscale_all_dim: Some(1.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
        };
        let (mut a, mut b) = (ours.clone(), ours.clone());
        a.yarn = Some(yarn(None, Some(1.0)));
        b.yarn = Some(yarn(Some(1.0), None));
        assert!(config_mismatches(&a, &b).is_empty());
        b.yarn = Some(crate::model::config::Yarn {
            factor: 4.0,
            ..yarn(None, Some(1.0))
        });
        assert_eq!(config_mismatches(&a, &b)[0].key, "rope_scaling");
    }

    #[test]
    fn a_config_json_in_a_trace_is_read_as_an_engine_s_settings() {
        let mut json = Glm5Config::glm5().to_hf_json();
        json["index_topk"] = Value::from(1024);
        let info = ModelInfo {
            source: "model".into(),
            config: json,
            fingerprint: String::new(),
            extra: Map::new(),
        };
        let settings = Settings::of(&info).unwrap().expect("a config.json");
        let found = settings.mismatches(&Glm5Config::glm5());
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].key, "index_topk");
        assert_eq!(found[0].spec.class, FaultClass::IndexerMismatch);
        // glmcheck's own traces record the parsed config: not an engine's settings.
        let own = ModelInfo {
            config: serde_json::to_value(Glm5Config::glm5()).unwrap(),
            ..info
        };
        assert!(Settings::of(&own).unwrap().is_none());
    }

    /// vLLM's DeepSeek attention renames its config's `yarn` to `deepseek_yarn` in place, and
    /// its probe records the config so: the same scaling as the reference's, no mismatch; a
    /// rotary scaling the family never runs is an error naming the field, not "no scaling".
    #[test]
    fn vllm_s_deepseek_yarn_is_the_reference_s_yarn_and_an_unknown_rope_type_is_an_error() {
        let mut json = Glm5Config::glm5().to_hf_json();
        json["model_type"] = "deepseek_v3".into();
        json["rope_parameters"] = serde_json::json!({
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
            "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0,
        });
        let ours = Glm5Config::from_hf_json(&json.to_string()).unwrap();
        assert!(ours.yarn.is_some());
        let info = |rope_type: &str| {
            let mut config = json.clone();
            config["rope_parameters"]["rope_type"] = rope_type.into();
            ModelInfo {
                source: "model".into(),
                config,
                fingerprint: String::new(),
                extra: Map::new(),
            }
        };
        let vllm = info("deepseek_yarn");
        let settings = Settings::of(&vllm).unwrap().expect("a config.json");
        assert!(settings.mismatches(&ours).is_empty());
        let default = info("default");
        let none = Settings::of(&default).unwrap().expect("a config.json");
        assert_eq!(none.mismatches(&ours)[0].key, "rope_scaling");
        let err = Settings::of(&info("linear"))
            .err()
            .expect("an error")
            .to_string();
        assert!(
            err.contains("rope_parameters.rope_type") && err.contains("linear"),
            "{err}"
        );
    }
}
