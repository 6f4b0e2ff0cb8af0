//! The stages of docs/design.md §4 in execution order, and the weights each one reads: what a
//! diagnosis checks when a stage is the first to diverge.

use super::names::LayerWeight::{self, *};
use super::names::WeightId;
use super::stage::{layer_of, Place, Stage};
use super::Glm5Config;

/// A layer's stages (after `L{n}.`) in the order the forward records them, docs/design.md §4's names
/// (`attn.q_a*` only with a q LoRA; `attn.index_topk` only with DSA; `moe.*` only in MoE
/// layers).
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
                .filter(|s| cfg.has_q_lora() || !s.starts_with("attn.q_a"))
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
        "attn.q" if cfg.has_q_lora() => &[QB],
        "attn.q" => &[QProj],
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
        "moe.topk_ids" | "moe.topk_weights" if cfg.topk_method.has_bias() => &[RouterBias],
        "moe.topk_ids" | "moe.topk_weights" => &[],
        "moe.routed" => &[ExpertsGate, ExpertsUp, ExpertsDown],
        "moe.shared" => &[SharedGate, SharedUp, SharedDown],
        "ffn.out" if !cfg.is_moe_layer(l) => &[Gate, Up, Down],
        _ => &[],
    };
    roles.iter().map(|&w| WeightId::Layer(l, w)).collect()
}

/// The weights every stage of layer `l` reads.
pub fn layer_weights(cfg: &Glm5Config, l: u64) -> Vec<WeightId> {
    let in_layer: Vec<String> = stage_names(cfg)
        .into_iter()
        .filter(|s| layer_of(s) == Some(l))
        .collect();
    weights_of(cfg, &in_layer)
}

/// The weights `stages` read, each once, in the order first read.
pub fn weights_of(cfg: &Glm5Config, stages: &[String]) -> Vec<WeightId> {
    let mut ids: Vec<WeightId> = Vec::new();
    for id in stages.iter().flat_map(|s| stage_weights(cfg, s)) {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
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

/// The stages whose values stage `stage` computes from (its data flow, not its recording
/// order): `attn.kv` feeds `attn.ctx` but not `attn.q_rope`, which is recorded between them.
pub fn stage_inputs(cfg: &Glm5Config, stage: &str) -> Vec<String> {
    let Some(parsed) = Stage::parse(stage) else {
        return Vec::new();
    };
    let l = match parsed.place() {
        Place::Embed => return Vec::new(),
        Place::FinalNorm => {
            let last = cfg.num_hidden_layers.max(1) - 1;
            return vec![Stage::layer_stage(last, "out").to_string()];
        }
        Place::Logits => return vec!["final_norm".into()],
        Place::Layer(l) => l,
    };
    let moe = cfg.is_moe_layer(l);
    let kinds: &[&str] = match parsed.kind() {
        "attn_norm" => return vec![Stage::layer_input(l).to_string()],
        "attn.q_a" | "attn.kv_a" => &["attn_norm"],
        "attn.q_a_norm" => &["attn.q_a"],
        "attn.q" if cfg.has_q_lora() => &["attn.q_a_norm"],
        "attn.q" => &["attn_norm"],
        "attn.kv_a_norm" => &["attn.kv_a"],
        "attn.kv" => &["attn.kv_a_norm"],
        "attn.q_rope" => &["attn.q"],
        "attn.k_rope" => &["attn.kv_a"],
        "attn.index_topk" => &["attn_norm", "attn.q_a_norm"],
        "attn.ctx" if cfg.has_dsa() => &[
            "attn.q",
            "attn.q_rope",
            "attn.kv",
            "attn.k_rope",
            "attn.index_topk",
        ],
        "attn.ctx" => &["attn.q", "attn.q_rope", "attn.kv", "attn.k_rope"],
        "attn.out" => &["attn.ctx"],
        "attn_resid" => {
            return vec![
                Stage::layer_input(l).to_string(),
                Stage::layer_stage(l, "attn.out").to_string(),
            ]
        }
        "ffn_norm" => &["attn_resid"],
        "moe.router_logits" | "moe.shared" => &["ffn_norm"],
        "moe.topk_ids" | "moe.topk_weights" => &["moe.router_logits"],
        "moe.routed" => &["ffn_norm", "moe.topk_ids", "moe.topk_weights"],
        "ffn.out" if moe => &["moe.routed", "moe.shared"],
        "ffn.out" => &["ffn_norm"],
        "out" => &["attn_resid", "ffn.out"],
        _ => &[],
    };
    kinds
        .iter()
        .map(|k| Stage::layer_stage(l, k).to_string())
        .collect()
}

/// The stages behind `stage` that no recorded agreement covers: walking `stage`'s inputs back,
/// every input `covered` says nothing of, and its own inputs in turn, until covered stages close
/// every way back. A fault in one of them shows first at `stage`. In the forward's order.
pub fn hidden_behind(cfg: &Glm5Config, stage: &str, covered: impl Fn(&str) -> bool) -> Vec<String> {
    let mut hidden: Vec<String> = Vec::new();
    let mut todo = stage_inputs(cfg, stage);
    while let Some(s) = todo.pop() {
        if covered(&s) || hidden.contains(&s) {
            continue;
        }
        todo.extend(stage_inputs(cfg, &s));
        hidden.push(s);
    }
    let order = stage_names(cfg);
    hidden.sort_by_key(|s| order.iter().position(|o| o == s).unwrap_or(usize::MAX));
    hidden
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

    #[test]
    fn every_input_comes_earlier_in_the_forward() {
        let cfg = Glm5Config {
            num_hidden_layers: 2,
            first_k_dense_replace: 1,
            ..Glm5Config::glm5()
        };
        let names = stage_names(&cfg);
        for (i, s) in names.iter().enumerate() {
            for input in stage_inputs(&cfg, s) {
                let at = names.iter().position(|n| *n == input);
                assert!(at.is_some_and(|a| a < i), "{s} reads {input}");
            }
            if i > 0 {
                assert!(!stage_inputs(&cfg, s).is_empty(), "{s} reads nothing");
            }
        }
    }

    #[test]
    fn hidden_stages_are_those_behind_the_divergence_up_to_recorded_ones() {
        let cfg = Glm5Config {
            num_hidden_layers: 2,
            first_k_dense_replace: 1,
            ..Glm5Config::glm5()
        };
        // llama.cpp's MLA never forms attn.kv; the stages recorded around it do not cover it.
        let llama = |s: &str| s != "L1.attn.kv";
        assert_eq!(hidden_behind(&cfg, "L1.attn.ctx", llama), ["L1.attn.kv"]);
        assert!(hidden_behind(&cfg, "L1.attn.q_rope", llama).is_empty());
        // A fused MoE: routing and experts unrecorded behind ffn.out.
        let fused = |s: &str| !s.starts_with("L1.moe.") || s == "L1.moe.router_logits";
        assert_eq!(
            hidden_behind(&cfg, "L1.ffn.out", fused),
            [
                "L1.moe.topk_ids",
                "L1.moe.topk_weights",
                "L1.moe.routed",
                "L1.moe.shared"
            ]
        );
        // Only the layer outputs recorded: the whole layer is behind its output.
        let outs = |s: &str| {
            s == "embed" || s.ends_with(".out") && !s.contains("attn") && !s.contains("ffn")
        };
        let behind = hidden_behind(&cfg, "L1.out", outs);
        assert!(behind.contains(&"L1.attn.kv".to_string()));
        assert!(!behind.iter().any(|s| s.starts_with("L0.")), "{behind:?}");
    }
}
