//! The settings an engine ran with that change its numbers without changing a shape, against
//! the reference's config: the GGUF metadata llama.cpp read (the llama.cpp probe records the
//! file's metadata in `model.config`), taken with the defaults llama.cpp's loader applies when a
//! key is absent, or the `config.json` a vLLM or transformers run took (their probes record it
//! there). A mismatch that changes the first divergent stage, or a stage hidden behind it, is
//! the cause, classified by what the setting does.

use serde_json::{Map, Value};

use crate::compare::diff::Divergence;
use crate::compare::{DiffReport, Fault, FaultClass, Status};
use crate::exec::ops::rope::{yarn_attention_factor, yarn_softmax_factor};
use crate::model::config::{glm_5_2_indexer_types, IndexerKind, HF_MODEL_TYPES};
use crate::model::stage::kind_of;
use crate::model::Glm5Config;
use crate::trace::ModelInfo;

/// A setting bisect compares: its GGUF key (without the arch prefix) where llama.cpp has one,
/// the reference config's fields of the same role, the stages (without `L{n}.`) it changes
/// first, any of which may be the first divergence, the class of what it does, and what it
/// does.
pub struct Key {
    pub key: Option<&'static str>,
    pub fields: &'static [&'static str],
    pub stages: &'static [&'static str],
    pub class: FaultClass,
    pub does: &'static str,
}

const ROPE: &[&str] = &["attn.q_rope", "attn.k_rope"];

/// Every setting compared with the reference's config (`bisect --list-faults` prints them): the
/// keys of llama.cpp's glm-dsa loader that change numbers without failing the load, and the
/// config fields of the same roles (two, the rotary styles, llama.cpp fixes by architecture).
/// The keys that fix a tensor's shape (widths, counts, ranks) are checked by the loader against
/// the tensors; [`OTHER_KEYS`] says what becomes of every other key read for glm-dsa.
pub const KEYS: [Key; 13] = [
    Key {
        key: Some("rope.scaling.type"),
        fields: &["yarn"],
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does:
            "the scaling (with `rope.scaling.factor` and `rope.scaling.original_context_length`) \
               rescales every rotary position or frequency",
    },
    Key {
        key: Some("rope.freq_base"),
        fields: &["rope_theta"],
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "the rotary frequencies follow the base",
    },
    Key {
        key: Some("attention.layer_norm_rms_epsilon"),
        fields: &["rms_norm_eps"],
        stages: &["attn_norm"],
        class: FaultClass::NormEpsMismatch,
        does: "every RMSNorm divides by sqrt(mean(x²) + eps)",
    },
    Key {
        key: Some("expert_weights_scale"),
        fields: &["routed_scaling_factor"],
        stages: &["moe.topk_weights"],
        class: FaultClass::ScaleMismatch,
        does: "the routing weights are multiplied by it",
    },
    Key {
        key: Some("expert_weights_norm"),
        fields: &["norm_topk_prob"],
        stages: &["moe.topk_weights"],
        class: FaultClass::RouterMismatch,
        does: "it decides whether the chosen experts' weights are divided by their sum",
    },
    Key {
        key: Some("rope.scaling.attn_factor"),
        fields: &["yarn"],
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "it multiplies every rotary embedding's magnitude, and its square the attention's \
               softmax scale",
    },
    Key {
        key: Some("attention.indexer.top_k"),
        fields: &["index_topk"],
        stages: &["attn.index_topk"],
        class: FaultClass::IndexerMismatch,
        does: "the DSA indexer keeps that many key positions for each query",
    },
    Key {
        key: Some("attention.indexer.types"),
        fields: &["indexer_types"],
        stages: &["attn.index_topk"],
        class: FaultClass::IndexerMismatch,
        does: "a layer marked 0 reuses the previous full layer's top-k instead of its own \
               (absent: every layer full below a context_length of 1048576, else GLM-5.2's \
               pattern)",
    },
    Key {
        key: Some("expert_used_count"),
        fields: &["num_experts_per_tok"],
        stages: &["moe.topk_ids"],
        class: FaultClass::RouterMismatch,
        does: "the router chooses that many experts for each token",
    },
    Key {
        key: Some("expert_group_count"),
        fields: &["n_group", "topk_group"],
        stages: &["moe.topk_ids"],
        class: FaultClass::RouterMismatch,
        does: "with more than one group (and `expert_group_used_count` fewer), the router \
               chooses experts only from the best groups",
    },
    Key {
        key: Some("expert_gating_func"),
        fields: &["scoring_func"],
        stages: &["moe.topk_ids", "moe.topk_weights"],
        class: FaultClass::RouterMismatch,
        does: "the router's scores, and so the experts chosen and their weights, come from it",
    },
    Key {
        key: None,
        fields: &["rope_interleave"],
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "MLA's rotary embedding turns adjacent pairs (true) or the two halves (false)",
    },
    Key {
        key: None,
        fields: &["indexer_rope_interleave"],
        stages: &["attn.index_topk"],
        class: FaultClass::IndexerMismatch,
        does: "the indexer's rotary embedding turns adjacent pairs (true) or the two halves \
               (false)",
    },
];

/// The other keys llama.cpp's loader reads for glm-dsa (its shared hyperparameters and the
/// arch's own), each with what becomes of it: compared as part of a key of [`KEYS`], checked
/// by the load against the tensors' shapes, without effect on the logits, or read only for
/// another architecture. A test holds this list and [`KEYS`] to llama.cpp's own source.
pub const OTHER_KEYS: [(&str, &str); 41] = [
    ("general.name", "informational"),
    (
        "context_length",
        "no effect on a prompt's logits; it picks the indexer types' default",
    ),
    (
        "embedding_length",
        "shapes every tensor: the load checks it",
    ),
    ("embedding_length_out", "embedding output only"),
    (
        "attention.causal",
        "not compared: false would make attention bidirectional, and no \
      fault class names an attention mask yet",
    ),
    ("pooling_type", "embedding output only"),
    ("classifier.pooling_type", "embedding output only"),
    ("classifier.output_labels", "classifier output only"),
    (
        "block_count",
        "the tensors' names and count: the load checks it",
    ),
    (
        "nextn_predict_layers",
        "the MTP tensors' names: the load checks it",
    ),
    (
        "expert_count",
        "the experts' tensors' shapes: the load checks it",
    ),
    (
        "expert_group_used_count",
        "compared with `expert_group_count`",
    ),
    (
        "feed_forward_length",
        "the dense layers' tensors' shapes: the load checks it",
    ),
    (
        "attention.head_count",
        "the attention tensors' shapes: the load checks it",
    ),
    (
        "attention.head_count_kv",
        "MLA's cache rows: a wrong value fails the first graph",
    ),
    ("rope.scaling.finetuned", "read, never used"),
    (
        "rope.scaling.original_context_length",
        "compared with `rope.scaling.type` under YaRN, \
      without effect otherwise",
    ),
    ("rope.scaling.factor", "compared with `rope.scaling.type`"),
    (
        "rope.scale_linear",
        "compared with `rope.scaling.type` (the factor's older name)",
    ),
    ("rope.scaling.alpha", "read, unused by glm-dsa"),
    (
        "attention.key_length",
        "MLA's cache rows and the rope width's default: the tensors' \
      shapes check it",
    ),
    ("attention.value_length", "unused by MLA"),
    (
        "rope.dimension_count",
        "the rope width: the tensors' shapes check it",
    ),
    (
        "attention.key_length_swa",
        "unused: glm-dsa has no sliding-window layers",
    ),
    (
        "attention.value_length_swa",
        "unused: glm-dsa has no sliding-window layers",
    ),
    (
        "rope.dimension_count_swa",
        "unused: glm-dsa has no sliding-window layers",
    ),
    ("features_length", "read only for WavTokenizer"),
    ("posnet.embedding_length", "read only for WavTokenizer"),
    ("posnet.block_count", "read only for WavTokenizer"),
    ("convnext.embedding_length", "read only for WavTokenizer"),
    ("convnext.block_count", "read only for WavTokenizer"),
    (
        "expert_feed_forward_length",
        "the experts' tensors' shapes: the load checks it",
    ),
    (
        "rope.dimension_sections",
        "unused: glm-dsa's rotary style is fixed",
    ),
    (
        "expert_shared_count",
        "the shared expert's tensors' shapes: the load checks it",
    ),
    (
        "leading_dense_block_count",
        "which layers hold dense or expert tensors: the load checks it",
    ),
    (
        "attention.q_lora_rank",
        "the q latent's tensors' shapes: the load checks it",
    ),
    (
        "attention.kv_lora_rank",
        "the kv latent's tensors' shapes: the load checks it",
    ),
    (
        "attention.key_length_mla",
        "the per-head key width: the tensors' shapes check it",
    ),
    (
        "attention.value_length_mla",
        "the per-head value width: the tensors' shapes check it",
    ),
    (
        "attention.indexer.head_count",
        "the indexer's tensors' shapes: the load checks it",
    ),
    (
        "attention.indexer.key_length",
        "the indexer's tensors' shapes: the load checks it",
    ),
];

/// One setting whose value the engine runs with differs from the reference's.
struct Mismatch {
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
            "softmax_scale": yarn_softmax_factor(cfg),
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

/// The recorded GGUF metadata of an engine trace, if it has any.
fn metadata(config: &Value) -> Option<&Map<String, Value>> {
    config
        .as_object()
        .filter(|m| m.get("general.architecture").is_some_and(Value::is_string))
}

/// f32 metadata against an f64 config value: equal up to f32 rounding.
fn differs(a: f64, b: f64) -> bool {
    (a - b).abs() > 1e-6 * a.abs().max(b.abs())
}

fn gguf_mismatches(meta: &Map<String, Value>, cfg: &Glm5Config) -> Vec<Mismatch> {
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
        assert_eq!(keys_found(&[long.clone()]), ["attention.indexer.types"]);
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
        cfg.yarn = Some(crate::model::config::Yarn {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            attention_factor: None,
            mscale: Some(1.0),
            mscale_all_dim: Some(1.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
        });
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
}
