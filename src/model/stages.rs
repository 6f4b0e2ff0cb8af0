//! The stages of docs/design.md §4 in execution order, and the weights each one reads: what a
//! diagnosis checks when a stage is the first to diverge.

use super::names::LayerWeight::{self, *};
use super::names::WeightId;
use super::stage::{layer_of, Place, Stage};
use super::Glm5Config;

/// A layer's stages (after `L{n}.`) in the order the forward records them, docs/design.md §4's names
/// (`attn.index_topk` only with DSA; `moe.*` only in MoE layers).
pub const LAYER_STAGES: &[&str] = &[
    "attn_norm",
    "attn.q_a",
    "attn.q_a_norm",
    "attn.q",
    "attn.kv_a",
    "attn.kv_a_norm",
    "attn.kv",
    "attn.q_rope",
    "attn.k_rope",
    "attn.index_topk",
    "attn.ctx",
    "attn.out",
    "attn_resid",
    "ffn_norm",
    "moe.router_logits",
    "moe.topk_ids",
    "moe.topk_weights",
    "moe.routed",
    "moe.shared",
    "ffn.out",
    "out",
];

/// Every stage name of `cfg`'s forward, in order.
pub fn stage_names(cfg: &Glm5Config) -> Vec<String> {
    let mut names = vec!["embed".to_string()];
    for l in 0..cfg.num_hidden_layers {
        let moe = cfg.is_moe_layer(l);
        names.extend(
            LAYER_STAGES
                .iter()
                .filter(|s| moe || !s.starts_with("moe."))
                .filter(|s| cfg.has_dsa() || **s != "attn.index_topk")
                .map(|s| Stage::layer_stage(l, s).to_string()),
        );
    }
    names.extend(["final_norm".to_string(), "logits".to_string()]);
    names
}

/// The weights stage `stage` reads directly (its inputs aside); routed experts stand for the
/// whole stacked tensors.
pub fn stage_weights(cfg: &Glm5Config, stage: &str) -> Vec<WeightId> {
    let Some(stage) = Stage::parse(stage) else {
        return Vec::new();
    };
    let l = match stage.place() {
        Place::Embed => return vec![WeightId::Embed],
        Place::FinalNorm => return vec![WeightId::FinalNorm],
        Place::Logits => return vec![WeightId::LmHead],
        Place::Layer(l) => l,
    };
    let roles: &[LayerWeight] = match stage.kind() {
        "attn_norm" => &[AttnNorm],
        "attn.q_a" => &[QA],
        "attn.q_a_norm" => &[QANorm],
        "attn.q" => &[QB],
        "attn.kv_a" => &[KvA],
        "attn.kv_a_norm" => &[KvANorm],
        "attn.kv" => &[KvB],
        "attn.index_topk" => &[
            IndexerQB,
            IndexerK,
            IndexerKNorm,
            IndexerKNormBias,
            IndexerProj,
        ],
        "attn.out" => &[AttnOut],
        "ffn_norm" => &[FfnNorm],
        "moe.router_logits" => &[Router],
        "moe.topk_ids" | "moe.topk_weights" => &[RouterBias],
        "moe.routed" => &[ExpertsGate, ExpertsUp, ExpertsDown],
        "moe.shared" => &[SharedGate, SharedUp, SharedDown],
        "ffn.out" if !cfg.is_moe_layer(l) => &[Gate, Up, Down],
        _ => &[],
    };
    roles.iter().map(|&w| WeightId::Layer(l, w)).collect()
}

/// The weights every stage of layer `l` reads.
pub fn layer_weights(cfg: &Glm5Config, l: u64) -> Vec<WeightId> {
    let mut ids: Vec<WeightId> = stage_names(cfg)
        .iter()
        .filter(|s| layer_of(s) == Some(l))
        .flat_map(|s| stage_weights(cfg, s))
        .collect();
    ids.dedup();
    ids
}

/// The weights read by `stage` and by the stages of its layer before it (a layer stage), or
/// by `stage` alone.
pub fn weights_up_to(cfg: &Glm5Config, stage: &str) -> Vec<WeightId> {
    let Some(l) = layer_of(stage) else {
        return stage_weights(cfg, stage);
    };
    let mut ids: Vec<WeightId> = Vec::new();
    for name in stage_names(cfg).iter().filter(|n| layer_of(n) == Some(l)) {
        for id in stage_weights(cfg, name) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        if name == stage {
            break;
        }
    }
    ids
}

/// The stage a layer weight feeds first: where a fault in that weight shows.
pub fn stage_of(cfg: &Glm5Config, l: u64, w: LayerWeight) -> Option<String> {
    stage_names(cfg)
        .into_iter()
        .filter(|s| layer_of(s) == Some(l))
        .find(|s| stage_weights(cfg, s).contains(&WeightId::Layer(l, w)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_follow_the_forward_and_name_their_weights() {
        let cfg = Glm5Config {
            num_hidden_layers: 2,
            first_k_dense_replace: 1,
            ..Glm5Config::glm5()
        };
        let names = stage_names(&cfg);
        assert_eq!(names[0], "embed");
        assert!(!names.contains(&"L0.moe.routed".to_string()));
        assert!(names.contains(&"L1.moe.routed".to_string()));
        assert_eq!(names.last().unwrap(), "logits");
        assert_eq!(stage_of(&cfg, 0, KvB).as_deref(), Some("L0.attn.kv"));
        assert_eq!(stage_of(&cfg, 0, Down).as_deref(), Some("L0.ffn.out"));
        assert_eq!(
            stage_of(&cfg, 1, SharedUp).as_deref(),
            Some("L1.moe.shared")
        );
        assert_eq!(stage_weights(&cfg, "L1.ffn.out"), vec![]);
    }
}
