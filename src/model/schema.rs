//! The GLM-5 tensor schema: which tensors a checkpoint of a given config must hold, in which
//! shapes, and how a real file's inventory compares (missing, unexpected, wrong shape).

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::config::Glm5Config;
use super::names::{LayerWeight, LayerWeight::*, WeightId};
use crate::weights::TensorEntry;

/// The checkpoint family, which decides the names and a few shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    Gguf,
    Hf,
}

/// How `kv_b_proj` is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvBForm {
    /// One `[heads·(nope+v), kv_lora]` matrix (HF, and GGUFs converted before the split).
    Whole,
    /// llama.cpp's `attn_k_b [heads, kv_lora, nope]` and `attn_v_b [heads, v, kv_lora]`.
    Split,
    /// The split tensors with heads folded into one dimension (2-D), as ik_llama.cpp writes them.
    SplitFolded,
}

/// How routed experts are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertForm {
    /// One 3-D tensor per projection `[E, out, in]` (GGUF).
    Stacked,
    /// One tensor per expert and projection (the original HF checkpoint).
    PerExpert,
    /// transformers' packed `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`.
    FusedGateUp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub family: Family,
    pub kv_b: KvBForm,
    pub experts: ExpertForm,
}

/// One tensor the schema expects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Expected {
    #[serde(skip)]
    pub id: WeightId,
    pub name: String,
    pub shape: Vec<u64>,
    /// Loaders do without it (GGUF `output.weight` falls back to the embedding).
    pub optional: bool,
    /// Belongs to an MTP layer, which the forward leaves out.
    pub mtp: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WrongShape {
    pub name: String,
    pub expected: Vec<u64>,
    pub found: Vec<u64>,
}

/// How a file's tensors compare with the schema.
#[derive(Clone, Debug, Serialize)]
pub struct SchemaReport {
    pub layout: Layout,
    pub expected: usize,
    pub found: usize,
    pub missing: Vec<String>,
    pub unexpected: Vec<String>,
    pub wrong_shape: Vec<WrongShape>,
    /// Layers stored after the forward's layers (MTP): recognised, not run. A Hugging Face
    /// folder may leave them all out (transformers saves none).
    pub mtp_layers: Vec<u64>,
}

impl SchemaReport {
    pub fn ok(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.wrong_shape.is_empty()
    }
}

/// Decide the layout from the tensor names present.
/// The role of a stored tensor by its name in `family`'s convention (FP8 scale tensors belong to
/// their weight).
pub fn role(family: Family, name: &str) -> Option<WeightId> {
    match family {
        Family::Gguf => WeightId::from_gguf(name),
        Family::Hf => WeightId::from_hf(name.trim_end_matches("_scale_inv")),
    }
}

pub fn detect_layout(family: Family, tensors: &[TensorEntry]) -> Layout {
    let has = |pred: &dyn Fn(&str) -> bool| tensors.iter().any(|t| pred(&t.name));
    let kv_b = match tensors
        .iter()
        .find(|t| t.name.ends_with(".attn_k_b.weight"))
    {
        Some(t) if t.shape.len() == 2 => KvBForm::SplitFolded,
        Some(_) => KvBForm::Split,
        None => KvBForm::Whole,
    };
    let experts = match family {
        Family::Gguf => ExpertForm::Stacked,
        Family::Hf if has(&|n| n.ends_with(".mlp.experts.gate_up_proj")) => ExpertForm::FusedGateUp,
        Family::Hf => ExpertForm::PerExpert,
    };
    Layout {
        family,
        kv_b,
        experts,
    }
}

/// Every tensor a checkpoint of `cfg` in `layout` holds, with its row-major shape.
pub fn expected(cfg: &Glm5Config, layout: Layout) -> Vec<Expected> {
    let mut out = Vec::new();
    let name = |id: WeightId| match layout.family {
        Family::Gguf => id.gguf_name(),
        Family::Hf => id.hf_name(),
    };
    let mut push = |id: WeightId, shape: Vec<u64>, optional: bool, mtp: bool| {
        out.push(Expected {
            id,
            name: name(id),
            shape,
            optional,
            mtp,
        });
    };
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    push(WeightId::Embed, vec![v, h], false, false);
    push(WeightId::FinalNorm, vec![h], false, false);
    push(
        WeightId::LmHead,
        vec![v, h],
        cfg.tie_word_embeddings || layout.family == Family::Gguf,
        false,
    );
    let total = cfg.num_hidden_layers + cfg.num_nextn_predict_layers;
    for l in 0..total {
        let mtp = l >= cfg.num_hidden_layers;
        for (w, shape, optional) in layer_weights(cfg, layout, l, mtp) {
            match w {
                ExpertsGate | ExpertsUp | ExpertsDown
                    if layout.experts == ExpertForm::PerExpert =>
                {
                    for e in 0..cfg.n_routed_experts {
                        push(
                            WeightId::Expert {
                                layer: l,
                                expert: e,
                                which: w,
                            },
                            shape[1..].to_vec(),
                            optional,
                            mtp,
                        );
                    }
                }
                _ => push(WeightId::Layer(l, w), shape, optional, mtp),
            }
        }
    }
    out
}

/// (role, shape, optional) of layer `l`'s weights; stacked expert shapes are `[E, out, in]`.
fn layer_weights(
    cfg: &Glm5Config,
    layout: Layout,
    l: u64,
    mtp: bool,
) -> Vec<(LayerWeight, Vec<u64>, bool)> {
    let h = cfg.hidden_size;
    let nh = cfg.num_attention_heads;
    let (nope, rope, vd) = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
    let (ql, kvl) = (cfg.q_lora_rank, cfg.kv_lora_rank);
    let mut w = vec![(AttnNorm, vec![h], false)];
    match cfg.has_q_lora() {
        true => w.extend([
            (QA, vec![ql, h], false),
            (QANorm, vec![ql], false),
            (QB, vec![nh * (nope + rope), ql], false),
        ]),
        false => w.push((QProj, vec![nh * (nope + rope), h], false)),
    }
    w.extend([
        (KvA, vec![kvl + rope, h], false),
        (KvANorm, vec![kvl], false),
        (AttnOut, vec![h, nh * vd], false),
        (FfnNorm, vec![h], false),
    ]);
    match layout.kv_b {
        KvBForm::Whole => w.push((KvB, vec![nh * (nope + vd), kvl], false)),
        KvBForm::Split => {
            w.push((KB, vec![nh, kvl, nope], false));
            w.push((VB, vec![nh, vd, kvl], false));
        }
        KvBForm::SplitFolded => {
            w.push((KB, vec![nh * kvl, nope], false));
            w.push((VB, vec![nh * vd, kvl], false));
        }
    }
    // MTP layers always carry an indexer; forward layers only where they run their own.
    if cfg.index_n_heads > 0 && (mtp || cfg.has_indexer(l)) {
        let (ih, ihd) = (cfg.index_n_heads, cfg.index_head_dim);
        w.extend([
            (IndexerQB, vec![ih * ihd, ql], false),
            (IndexerK, vec![ihd, h], false),
            (IndexerKNorm, vec![ihd], false),
            (IndexerKNormBias, vec![ihd], false),
            (IndexerProj, vec![ih, h], false),
        ]);
    }
    if cfg.is_moe_layer(l) {
        let (e, ie) = (cfg.n_routed_experts, cfg.moe_intermediate_size);
        w.push((Router, vec![e, h], false));
        if cfg.topk_method.has_bias() {
            w.push((RouterBias, vec![e], false));
        }
        if layout.experts == ExpertForm::FusedGateUp {
            w.push((ExpertsGateUp, vec![e, 2 * ie, h], false));
        } else {
            w.push((ExpertsGate, vec![e, ie, h], false));
            w.push((ExpertsUp, vec![e, ie, h], false));
        }
        w.push((ExpertsDown, vec![e, h, ie], false));
        if cfg.n_shared_experts > 0 {
            let si = ie * cfg.n_shared_experts;
            w.extend([
                (SharedGate, vec![si, h], false),
                (SharedUp, vec![si, h], false),
                (SharedDown, vec![h, si], false),
            ]);
        }
    } else {
        let i = cfg.intermediate_size;
        w.extend([
            (Gate, vec![i, h], false),
            (Up, vec![i, h], false),
            (Down, vec![h, i], false),
        ]);
    }
    if mtp {
        w.extend([
            (NextnEhProj, vec![h, 2 * h], false),
            (NextnEnorm, vec![h], false),
            (NextnHnorm, vec![h], false),
            (NextnSharedHeadNorm, vec![h], false),
            (NextnEmbed, vec![cfg.vocab_size, h], true),
            (NextnSharedHeadHead, vec![cfg.vocab_size, h], true),
        ]);
    }
    w
}

/// Compare a file's tensors with the schema of `cfg`.
pub fn check(cfg: &Glm5Config, family: Family, tensors: &[TensorEntry]) -> SchemaReport {
    let layout = detect_layout(family, tensors);
    let exp = expected(cfg, layout);
    let found: BTreeMap<&str, &TensorEntry> =
        tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let known: BTreeSet<&str> = exp.iter().map(|e| e.name.as_str()).collect();
    // transformers' classes have no MTP module, so a folder they saved holds none of the MTP
    // layers its config counts: such a layer is absent, not incomplete.
    let stored_mtp: BTreeSet<u64> = exp
        .iter()
        .filter(|e| e.mtp && found.contains_key(e.name.as_str()))
        .filter_map(|e| e.id.layer())
        .collect();
    let absent = |e: &Expected| {
        family == Family::Hf && e.mtp && !e.id.layer().is_some_and(|l| stored_mtp.contains(&l))
    };
    let mut missing = Vec::new();
    let mut wrong_shape = Vec::new();
    for e in &exp {
        match found.get(e.name.as_str()) {
            None if !e.optional && !absent(e) => missing.push(e.name.clone()),
            Some(t) if t.shape != e.shape => wrong_shape.push(WrongShape {
                name: e.name.clone(),
                expected: e.shape.clone(),
                found: t.shape.clone(),
            }),
            _ => {}
        }
    }
    let unexpected = tensors
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !known.contains(n) && !is_companion(n, &known))
        .map(String::from)
        .collect();
    let mtp_layers = (cfg.num_hidden_layers..cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
        .filter(|l| family == Family::Gguf || stored_mtp.contains(l))
        .collect();
    SchemaReport {
        layout,
        expected: exp.len(),
        found: tensors.len(),
        missing,
        unexpected,
        wrong_shape,
        mtp_layers,
    }
}

/// Tensors that travel with a known weight without being one: FP8 block scales, and llama.cpp's
/// optional precomputed `rope_freqs`.
fn is_companion(name: &str, known: &BTreeSet<&str>) -> bool {
    if let Some(base) = name.strip_suffix("_scale_inv") {
        return known.contains(base);
    }
    name == "rope_freqs.weight"
}
