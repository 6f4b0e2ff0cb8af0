//! An engine trace of a GGUF (the llama.cpp probe records the file's metadata in
//! `model.config`): the metadata that changes llama.cpp's glm-dsa forward, read with the
//! defaults llama.cpp's loader applies when a key is absent, against the reference's config. A
//! mismatch that changes the first divergent stage is the cause, classified by what the key does.

use std::path::PathBuf;

use serde_json::{Map, Value};

use crate::compare::diff::Divergence;
use crate::compare::{DiffReport, Fault, FaultClass, Status};
use crate::model::stage::kind_of;
use crate::model::Glm5Config;
use crate::trace::ModelInfo;

/// A key of the metadata bisect reads: the stages (without `L{n}.`) it changes first, any of
/// which may be the first divergence, the class of what it does, and what it does.
pub struct Key {
    pub key: &'static str,
    pub stages: &'static [&'static str],
    pub class: FaultClass,
    pub does: &'static str,
}

const ROPE: &[&str] = &["attn.q_rope", "attn.k_rope"];

/// Every key compared with the reference's config (`bisect --list-faults` prints them).
pub const KEYS: [Key; 6] = [
    Key {
        key: "rope.scaling.type",
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "the scaling (and `rope.scaling.factor`) rescales every rotary position or frequency",
    },
    Key {
        key: "rope.freq_base",
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "the rotary frequencies follow the base",
    },
    Key {
        key: "attention.layer_norm_rms_epsilon",
        stages: &["attn_norm"],
        class: FaultClass::NormEpsMismatch,
        does: "every RMSNorm divides by sqrt(mean(x²) + eps)",
    },
    Key {
        key: "expert_weights_scale",
        stages: &["moe.topk_weights"],
        class: FaultClass::ScaleMismatch,
        does: "the routing weights are multiplied by it",
    },
    Key {
        key: "expert_weights_norm",
        stages: &["moe.topk_weights"],
        class: FaultClass::RouterMismatch,
        does: "it decides whether the chosen experts' weights are divided by their sum",
    },
    Key {
        key: "expert_gating_func",
        stages: &["moe.topk_ids", "moe.topk_weights"],
        class: FaultClass::RouterMismatch,
        does: "the router's scores, and so the experts chosen and their weights, come from it",
    },
];

/// One key whose value llama.cpp runs differs from the reference.
struct Mismatch {
    key: String,
    /// What llama.cpp runs with and what the reference has, in words.
    found: String,
    spec: &'static Key,
}

/// The recorded GGUF metadata of an engine trace, if it has any.
pub fn metadata(config: &Value) -> Option<&Map<String, Value>> {
    config
        .as_object()
        .filter(|m| m.get("general.architecture").is_some_and(Value::is_string))
}

/// The GGUF an engine trace ran, when the trace records its metadata and the file is at hand
/// and quantized (`general.file_type` other than all-F32, F16 or BF16).
pub fn quantized_source(info: &ModelInfo) -> Option<PathBuf> {
    let file_type = metadata(&info.config)?.get("general.file_type")?.as_u64()?;
    let path = PathBuf::from(&info.source);
    (!matches!(file_type, 0 | 1 | 32) && path.is_file()).then_some(path)
}

/// f32 metadata against an f64 config value: equal up to f32 rounding.
fn differs(a: f64, b: f64) -> bool {
    (a - b).abs() > 1e-6 * a.abs().max(b.abs())
}

fn mismatches(meta: &Map<String, Value>, cfg: &Glm5Config) -> Vec<Mismatch> {
    let arch = meta["general.architecture"].as_str().unwrap_or_default();
    let get = |k: &str| meta.get(&format!("{arch}.{k}"));
    let num = |k: &str| get(k).and_then(Value::as_f64);
    let mut out = Vec::new();
    let mut add = |key: &str, found: String| {
        let spec = KEYS.iter().find(|k| k.key == key).expect("a key of KEYS");
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
        _ => None,
    };
    if let Some(found) = scaling_found {
        add("rope.scaling.type", found);
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
    // glm-dsa: absent or 0 reads as sigmoid; 1 softmax, 2 sigmoid, 3 softmax over the chosen.
    let gating = match get("expert_gating_func").and_then(Value::as_u64) {
        None | Some(0) | Some(2) => "sigmoid",
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

/// The stage without its layer prefix.
fn kind(stage: &str) -> &str {
    kind_of(stage).unwrap_or(stage)
}

/// Name the metadata mismatch that changes the first divergent stage, if one does; every
/// other mismatch is listed as evidence. Where every stage passed, a mismatch still fails the
/// run, at the first stage it changes (as the weight check does). Returns whether the metadata
/// decided the class.
pub fn explain(meta: &Map<String, Value>, cfg: &Glm5Config, report: &mut DiffReport) -> bool {
    let found = mismatches(meta, cfg);
    let inside = report.first_divergence.is_none();
    let (stage, cause) = match &report.first_divergence {
        Some(d) => match found
            .iter()
            .find(|m| m.spec.stages.contains(&kind(&d.stage)))
        {
            Some(m) => (d.stage.clone(), m),
            None => {
                if let Some(f) = &mut report.fault {
                    for m in &found {
                        f.evidence
                            .push(format!("GGUF metadata {} = {}", m.key, m.found));
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
    let mut evidence = vec![format!(
        "{} is what llama.cpp read (absent keys as its loader defaults them)",
        cause.key
    )];
    if inside {
        if let Some(s) = report.stages.iter().find(|s| s.stage == stage) {
            evidence.push(format!(
                "{stage}: rel_diff {:.3e}, inside its tolerance {:.3e}; the metadata alone fails \
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
        evidence.push(format!("also GGUF metadata {} = {}", m.key, m.found));
    }
    report.fault = Some(Fault {
        class: cause.spec.class,
        summary: format!(
            "GGUF metadata {} = {}: {} — first seen at {stage}",
            cause.key, cause.found, cause.spec.does
        ),
        evidence,
        weight: None,
    });
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GLM-5's config as a converter writes it into `glm-dsa.*`, with `edit` applied.
    fn keys_found(edit: &[(&str, Option<Value>)]) -> Vec<&'static str> {
        let mut meta: Map<String, Value> = serde_json::from_value(serde_json::json!({
            "general.architecture": "glm-dsa",
            "glm-dsa.rope.freq_base": 1e6,
            "glm-dsa.attention.layer_norm_rms_epsilon": 1e-5,
            "glm-dsa.expert_weights_scale": 2.5,
            "glm-dsa.expert_weights_norm": true,
            "glm-dsa.expert_gating_func": 2,
        }))
        .unwrap();
        for (k, v) in edit {
            match v {
                Some(v) => meta.insert(format!("glm-dsa.{k}"), v.clone()),
                None => meta.remove(&format!("glm-dsa.{k}")),
            };
        }
        mismatches(&meta, &Glm5Config::glm5())
            .iter()
            .map(|m| m.spec.key)
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
}
