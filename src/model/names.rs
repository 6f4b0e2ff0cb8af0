//! The family's weights by role, and their names in GGUF (llama.cpp) and Hugging Face checkpoints.
//!
//! One table pairs each per-layer role with both names, so the two directions cannot drift apart.

use std::fmt;

/// What a per-layer weight is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerWeight {
    AttnNorm,
    /// The whole query projection of a model without q LoRA (DeepSeek-V2-Lite).
    QProj,
    QA,
    QANorm,
    QB,
    KvA,
    KvANorm,
    /// The unsplit `kv_b_proj` (HF, and legacy GGUF `attn_kv_b`).
    KvB,
    /// llama.cpp's per-head, transposed W_UK part of `kv_b_proj`.
    KB,
    /// llama.cpp's per-head W_UV part of `kv_b_proj`.
    VB,
    AttnOut,
    FfnNorm,
    Gate,
    Up,
    Down,
    Router,
    RouterBias,
    ExpertsGate,
    ExpertsUp,
    ExpertsDown,
    /// transformers' fused `[gate; up]` expert tensor `[E, 2I, H]`.
    ExpertsGateUp,
    SharedGate,
    SharedUp,
    SharedDown,
    IndexerQB,
    IndexerK,
    IndexerKNorm,
    IndexerKNormBias,
    IndexerProj,
    NextnEhProj,
    NextnEnorm,
    NextnHnorm,
    NextnSharedHeadNorm,
    NextnEmbed,
    NextnSharedHeadHead,
}

/// A weight of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightId {
    Embed,
    FinalNorm,
    LmHead,
    Layer(u64, LayerWeight),
    /// One routed expert's matrix in a one-tensor-per-expert checkpoint (`which` is
    /// `ExpertsGate`, `ExpertsUp` or `ExpertsDown`).
    Expert {
        layer: u64,
        expert: u64,
        which: LayerWeight,
    },
}

use LayerWeight::*;

/// (role, GGUF name after `blk.N.`, HF name after `model.layers.N.`).
const LAYER_NAMES: &[(LayerWeight, &str, &str)] = &[
    (AttnNorm, "attn_norm.weight", "input_layernorm.weight"),
    (QProj, "attn_q.weight", "self_attn.q_proj.weight"),
    (QA, "attn_q_a.weight", "self_attn.q_a_proj.weight"),
    (
        QANorm,
        "attn_q_a_norm.weight",
        "self_attn.q_a_layernorm.weight",
    ),
    (QB, "attn_q_b.weight", "self_attn.q_b_proj.weight"),
    (
        KvA,
        "attn_kv_a_mqa.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
    ),
    (
        KvANorm,
        "attn_kv_a_norm.weight",
        "self_attn.kv_a_layernorm.weight",
    ),
    (KvB, "attn_kv_b.weight", "self_attn.kv_b_proj.weight"),
    (KB, "attn_k_b.weight", "self_attn.k_b_proj.weight"),
    (VB, "attn_v_b.weight", "self_attn.v_b_proj.weight"),
    (AttnOut, "attn_output.weight", "self_attn.o_proj.weight"),
    (
        FfnNorm,
        "ffn_norm.weight",
        "post_attention_layernorm.weight",
    ),
    (Gate, "ffn_gate.weight", "mlp.gate_proj.weight"),
    (Up, "ffn_up.weight", "mlp.up_proj.weight"),
    (Down, "ffn_down.weight", "mlp.down_proj.weight"),
    (Router, "ffn_gate_inp.weight", "mlp.gate.weight"),
    (
        RouterBias,
        "exp_probs_b.bias",
        "mlp.gate.e_score_correction_bias",
    ),
    (ExpertsGate, "ffn_gate_exps.weight", "mlp.experts.gate_proj"),
    (ExpertsUp, "ffn_up_exps.weight", "mlp.experts.up_proj"),
    (ExpertsDown, "ffn_down_exps.weight", "mlp.experts.down_proj"),
    (
        ExpertsGateUp,
        "ffn_gate_up_exps.weight",
        "mlp.experts.gate_up_proj",
    ),
    (
        SharedGate,
        "ffn_gate_shexp.weight",
        "mlp.shared_experts.gate_proj.weight",
    ),
    (
        SharedUp,
        "ffn_up_shexp.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
    (
        SharedDown,
        "ffn_down_shexp.weight",
        "mlp.shared_experts.down_proj.weight",
    ),
    (
        IndexerQB,
        "indexer.attn_q_b.weight",
        "self_attn.indexer.wq_b.weight",
    ),
    (
        IndexerK,
        "indexer.attn_k.weight",
        "self_attn.indexer.wk.weight",
    ),
    (
        IndexerKNorm,
        "indexer.k_norm.weight",
        "self_attn.indexer.k_norm.weight",
    ),
    (
        IndexerKNormBias,
        "indexer.k_norm.bias",
        "self_attn.indexer.k_norm.bias",
    ),
    (
        IndexerProj,
        "indexer.proj.weight",
        "self_attn.indexer.weights_proj.weight",
    ),
    (NextnEhProj, "nextn.eh_proj.weight", "eh_proj.weight"),
    (NextnEnorm, "nextn.enorm.weight", "enorm.weight"),
    (NextnHnorm, "nextn.hnorm.weight", "hnorm.weight"),
    (
        NextnSharedHeadNorm,
        "nextn.shared_head_norm.weight",
        "shared_head.norm.weight",
    ),
    (
        NextnEmbed,
        "nextn.embed_tokens.weight",
        "embed_tokens.weight",
    ),
    (
        NextnSharedHeadHead,
        "nextn.shared_head_head.weight",
        "shared_head.head.weight",
    ),
];

/// (weight, GGUF name, HF name) of the weights outside the layers.
const GLOBAL_NAMES: &[(WeightId, &str, &str)] = &[
    (
        WeightId::Embed,
        "token_embd.weight",
        "model.embed_tokens.weight",
    ),
    (
        WeightId::FinalNorm,
        "output_norm.weight",
        "model.norm.weight",
    ),
    (WeightId::LmHead, "output.weight", "lm_head.weight"),
];

fn layer_row(w: LayerWeight) -> &'static (LayerWeight, &'static str, &'static str) {
    LAYER_NAMES
        .iter()
        .find(|r| r.0 == w)
        .expect("every LayerWeight is in LAYER_NAMES")
}

impl WeightId {
    /// The llama.cpp GGUF name.
    pub fn gguf_name(&self) -> String {
        match *self {
            WeightId::Layer(l, w) => format!("blk.{l}.{}", layer_row(w).1),
            WeightId::Expert {
                layer,
                expert,
                which,
            } => format!("blk.{layer}.{}.{expert}", layer_row(which).1),
            global => GLOBAL_NAMES
                .iter()
                .find(|r| r.0 == global)
                .map(|r| r.1.to_string())
                .unwrap_or_default(),
        }
    }

    /// The Hugging Face checkpoint name.
    pub fn hf_name(&self) -> String {
        match *self {
            WeightId::Layer(l, w) => format!("model.layers.{l}.{}", layer_row(w).2),
            WeightId::Expert {
                layer,
                expert,
                which,
            } => {
                let part = layer_row(which).2.trim_start_matches("mlp.experts.");
                format!("model.layers.{layer}.mlp.experts.{expert}.{part}.weight")
            }
            global => GLOBAL_NAMES
                .iter()
                .find(|r| r.0 == global)
                .map(|r| r.2.to_string())
                .unwrap_or_default(),
        }
    }

    /// Recognise a GGUF tensor name.
    pub fn from_gguf(name: &str) -> Option<WeightId> {
        if let Some(r) = GLOBAL_NAMES.iter().find(|r| r.1 == name) {
            return Some(r.0);
        }
        let (layer, rest) = split_layer(name, "blk.")?;
        LAYER_NAMES
            .iter()
            .find(|r| r.1 == rest)
            .map(|r| WeightId::Layer(layer, r.0))
    }

    /// Recognise a Hugging Face tensor name (per-expert names included).
    pub fn from_hf(name: &str) -> Option<WeightId> {
        if let Some(r) = GLOBAL_NAMES.iter().find(|r| r.2 == name) {
            return Some(r.0);
        }
        let (layer, rest) = split_layer(name, "model.layers.")?;
        if let Some(r) = LAYER_NAMES.iter().find(|r| r.2 == rest) {
            return Some(WeightId::Layer(layer, r.0));
        }
        let tail = rest.strip_prefix("mlp.experts.")?;
        let (expert, part) = tail.split_once('.')?;
        let expert = expert.parse().ok()?;
        let which = match part {
            "gate_proj.weight" => ExpertsGate,
            "up_proj.weight" => ExpertsUp,
            "down_proj.weight" => ExpertsDown,
            _ => return None,
        };
        Some(WeightId::Expert {
            layer,
            expert,
            which,
        })
    }

    pub fn layer(&self) -> Option<u64> {
        match *self {
            WeightId::Layer(l, _) | WeightId::Expert { layer: l, .. } => Some(l),
            _ => None,
        }
    }
}

/// `prefix` `N` `.` `rest` → (N, rest), with N a decimal without sign.
fn split_layer<'a>(name: &'a str, prefix: &str) -> Option<(u64, &'a str)> {
    let tail = name.strip_prefix(prefix)?;
    let (n, rest) = tail.split_once('.')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((n.parse().ok()?, rest))
}

impl fmt::Display for WeightId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hf_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layer_weight_maps_both_ways() {
        for &(w, _, _) in LAYER_NAMES {
            let id = WeightId::Layer(7, w);
            assert_eq!(WeightId::from_gguf(&id.gguf_name()), Some(id));
            assert_eq!(WeightId::from_hf(&id.hf_name()), Some(id));
        }
        for &(id, g, h) in GLOBAL_NAMES {
            assert_eq!(WeightId::from_gguf(g), Some(id));
            assert_eq!(WeightId::from_hf(h), Some(id));
        }
    }

    #[test]
    fn names_match_llama_cpp_and_transformers() {
        assert_eq!(WeightId::Layer(3, KB).gguf_name(), "blk.3.attn_k_b.weight");
        assert_eq!(
            WeightId::Layer(3, RouterBias).gguf_name(),
            "blk.3.exp_probs_b.bias"
        );
        assert_eq!(
            WeightId::Layer(3, RouterBias).hf_name(),
            "model.layers.3.mlp.gate.e_score_correction_bias"
        );
        let e = WeightId::Expert {
            layer: 4,
            expert: 17,
            which: ExpertsDown,
        };
        assert_eq!(
            e.hf_name(),
            "model.layers.4.mlp.experts.17.down_proj.weight"
        );
        assert_eq!(WeightId::from_hf(&e.hf_name()), Some(e));
        assert_eq!(WeightId::from_gguf("blk.x.attn_norm.weight"), None);
        assert_eq!(WeightId::from_gguf("blk.1.nonsense.weight"), None);
    }
}
