//! The forward's switches as a config sets them, and which of them set a member apart from
//! GLM-5: what `inspect` shows so that a reader sees at once how DeepSeek-V2 or Kimi-K2 runs.

use serde::Serialize;

use super::config::Glm5Config;

/// One switch of the forward, with this config's setting and GLM-5's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Switch {
    pub name: &'static str,
    pub value: String,
    pub glm5: String,
}

/// Every switch, in the order the forward meets them.
pub fn switches(cfg: &Glm5Config) -> Vec<Switch> {
    let glm5 = settings(&Glm5Config::glm5());
    settings(cfg)
        .into_iter()
        .zip(glm5)
        .map(|((name, value), (_, glm5))| Switch { name, value, glm5 })
        .collect()
}

/// The switches set otherwise than GLM-5 sets them.
pub fn differences(cfg: &Glm5Config) -> Vec<Switch> {
    switches(cfg)
        .into_iter()
        .filter(|s| s.value != s.glm5)
        .collect()
}

fn settings(cfg: &Glm5Config) -> Vec<(&'static str, String)> {
    let rotation = |interleaved: bool| match interleaved {
        true => "interleaved pairs",
        false => "NeoX halves",
    };
    let yes_no = |b: bool| if b { "yes" } else { "no" }.to_string();
    vec![
        (
            "query",
            match cfg.has_q_lora() {
                true => "q LoRA (q_a_proj, norm, q_b_proj)".into(),
                false => "q_proj from the hidden state".into(),
            },
        ),
        (
            "attention",
            match cfg.has_dsa() {
                true => "MLA with the DSA indexer".into(),
                false => "MLA, dense".into(),
            },
        ),
        ("mla_rope", rotation(cfg.rope_interleave).into()),
        (
            "indexer_rope",
            match cfg.has_dsa() {
                true => rotation(cfg.indexer_rope_interleave).into(),
                false => "none".into(),
            },
        ),
        (
            "rope_scaling",
            match &cfg.yarn {
                Some(y) => format!("YaRN ×{}", y.factor),
                None => "none".into(),
            },
        ),
        ("scoring", cfg.scoring_func.clone()),
        ("topk_method", cfg.topk_method.name().into()),
        ("correction_bias", yes_no(cfg.topk_method.has_bias())),
        (
            "expert_groups",
            format!("{} of {}", cfg.topk_group, cfg.n_group),
        ),
        ("norm_topk_prob", yes_no(cfg.norm_topk_prob)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::Member;

    #[test]
    fn glm5_differs_from_itself_in_nothing_deepseek_v2_lite_in_its_router_and_query() {
        assert!(differences(&Glm5Config::glm5()).is_empty());
        let lite = Glm5Config::from_hf_json(
            r#"{"model_type": "deepseek_v2", "q_lora_rank": null, "num_experts_per_tok": 6}"#,
        )
        .unwrap();
        assert_eq!(lite.member, Member::DeepseekV2);
        let names: Vec<&str> = differences(&lite).iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            [
                "query",
                "attention",
                "indexer_rope",
                "scoring",
                "topk_method",
                "correction_bias",
                "norm_topk_prob"
            ]
        );
    }
}
