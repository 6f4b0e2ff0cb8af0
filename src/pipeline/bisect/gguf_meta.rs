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

/// Every key compared with the reference's config (`bisect --list-faults` prints them): those
/// of llama.cpp's glm-dsa loader that change numbers without failing the load. The keys that
/// fix a tensor's shape (widths, counts, ranks) are checked by the loader against the tensors.
pub const KEYS: [Key; 10] = [
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
        key: "rope.scaling.attn_factor",
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "it multiplies every rotary embedding's magnitude, and its square the attention's \
               softmax scale",
    },
    Key {
        key: "attention.indexer.top_k",
        stages: &["attn.index_topk"],
        class: FaultClass::IndexerMismatch,
        does: "the DSA indexer keeps that many key positions for each query",
    },
    Key {
        key: "expert_used_count",
        stages: &["moe.topk_ids"],
        class: FaultClass::RouterMismatch,
        does: "the router chooses that many experts for each token",
    },
    Key {
        key: "expert_group_count",
        stages: &["moe.topk_ids"],
        class: FaultClass::RouterMismatch,
        does: "with more than one group (and `expert_group_used_count` fewer), the router \
               chooses experts only from the best groups",
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
    // Absent: 1; it scales cos and sin and, squared, the softmax. YaRN's own factor is
    // another matter (the reference's mscales), left to `rope.scaling.type`.
    let attn_factor = num("rope.scaling.attn_factor").unwrap_or(1.0);
    if cfg.yarn.is_none() && differs(attn_factor, 1.0) {
        let found = format!("{attn_factor}, where the reference has no rope_scaling (1)");
        add("rope.scaling.attn_factor", found);
    }
    // Required by llama.cpp's loader: a trace exists only where the file has them.
    let count = |k: &str| get(k).and_then(Value::as_u64);
    if let Some(k) = count("attention.indexer.top_k") {
        if cfg.has_dsa() && k != cfg.index_topk {
            let found = format!(
                "{k}, where the reference's index_topk is {}",
                cfg.index_topk
            );
            add("attention.indexer.top_k", found);
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

/// The keys of [`KEYS`] (with the arch prefix) that change one of `stages`, for the report of
/// what was compared on a divergence's path; none without metadata.
pub fn keys_on(meta: Option<&Map<String, Value>>, stages: &[String]) -> Vec<String> {
    let Some(arch) = meta.and_then(|m| m.get("general.architecture")?.as_str()) else {
        return Vec::new();
    };
    KEYS.iter()
        .filter(|k| stages.iter().any(|s| k.stages.contains(&kind(s))))
        .map(|k| format!("{arch}.{}", k.key))
        .collect()
}

/// Name the metadata mismatch that changes the first divergent stage or a stage the trace does
/// not hold behind it (`path`: those stages and the divergent one), if one does; every other
/// mismatch is listed as evidence. Where every stage passed, a mismatch still fails the run, at
/// the first stage it changes (as the weight check does). Returns whether the metadata decided
/// the class.
pub fn explain(
    meta: &Map<String, Value>,
    cfg: &Glm5Config,
    report: &mut DiffReport,
    path: &[String],
) -> bool {
    let found = mismatches(meta, cfg);
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
            keys_on(Some(&meta), &path),
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
}
