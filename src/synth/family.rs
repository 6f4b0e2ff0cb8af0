//! `synth --family`: a preset's widths with one member's switches, set as that member's
//! published config sets them (its routing, groups, scales, query path, RoPE and YaRN).

use crate::model::config::{Glm5Config, IndexerKind, Member, TopkMethod, Yarn};

/// A member as `synth --family` names it (V2-Lite apart from V2: it has no q LoRA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthFamily {
    Glm5,
    Glm47Flash,
    DeepseekV2,
    DeepseekV2Lite,
    DeepseekV3,
    DeepseekV32,
    KimiK2,
}

impl SynthFamily {
    pub const ALL: [SynthFamily; 7] = [
        SynthFamily::Glm5,
        SynthFamily::Glm47Flash,
        SynthFamily::DeepseekV2,
        SynthFamily::DeepseekV2Lite,
        SynthFamily::DeepseekV3,
        SynthFamily::DeepseekV32,
        SynthFamily::KimiK2,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            SynthFamily::Glm5 => "glm5",
            SynthFamily::Glm47Flash => "glm-4.7-flash",
            SynthFamily::DeepseekV2 => "deepseek-v2",
            SynthFamily::DeepseekV2Lite => "deepseek-v2-lite",
            SynthFamily::DeepseekV3 => "deepseek-v3",
            SynthFamily::DeepseekV32 => "deepseek-v3.2",
            SynthFamily::KimiK2 => "kimi-k2",
        }
    }

    /// `cfg`'s widths with this member's switches.
    pub fn apply(self, cfg: Glm5Config) -> Glm5Config {
        let e = cfg.n_routed_experts;
        let k = cfg.num_experts_per_tok;
        // DeepSeek's eight groups of which four compete, scaled down to the preset's experts:
        // the most groups (at most 8) of two or more experts whose open half holds k.
        let (groups, open) = [8, 4, 2]
            .into_iter()
            .map(|g| (g, g / 2))
            .find(|&(g, open)| e.is_multiple_of(g) && e / g >= 2 && open * (e / g) >= k)
            .unwrap_or((1, 1));
        let v3 = |member, c: Glm5Config| Glm5Config {
            member,
            n_group: groups,
            topk_group: open,
            routed_scaling_factor: 2.5,
            rms_norm_eps: 1e-6,
            yarn: Some(Yarn::deepseek(40.0, 4096)),
            ..c
        };
        // V2 chooses 6 experts from the best 3 groups by their best score: fewer groups than
        // experts chosen, or the limit would change nothing.
        let (v2_groups, v2_open) = [8, 4, 2]
            .into_iter()
            .map(|g| (g, k.div_ceil(2).max(1)))
            .find(|&(g, open)| e.is_multiple_of(g) && open < g && open * (e / g) >= k)
            .unwrap_or((1, 1));
        let v2 = |c: Glm5Config| Glm5Config {
            member: Member::DeepseekV2,
            scoring_func: "softmax".into(),
            topk_method: TopkMethod::GroupLimitedGreedy,
            norm_topk_prob: false,
            routed_scaling_factor: 16.0,
            n_group: v2_groups,
            topk_group: v2_open,
            rms_norm_eps: 1e-6,
            ..c.without_indexer()
        };
        match self {
            SynthFamily::Glm5 => cfg,
            SynthFamily::Glm47Flash => Glm5Config {
                member: Member::Glm47Flash,
                routed_scaling_factor: 1.8,
                ..cfg.without_indexer()
            },
            SynthFamily::DeepseekV2 => v2(cfg),
            SynthFamily::DeepseekV2Lite => Glm5Config {
                q_lora_rank: 0,
                topk_method: TopkMethod::Greedy,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0,
                ..v2(cfg)
            },
            SynthFamily::DeepseekV3 => v3(Member::DeepseekV3, cfg).without_indexer(),
            SynthFamily::DeepseekV32 => {
                let layers = cfg.num_hidden_layers as usize;
                Glm5Config {
                    indexer_rope_interleave: false,
                    indexer_types: vec![IndexerKind::Full; layers],
                    ..v3(Member::DeepseekV32, cfg)
                }
            }
            SynthFamily::KimiK2 => Glm5Config {
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 2.827,
                yarn: Some(Yarn::deepseek(32.0, 4096)),
                ..v3(Member::KimiK2, cfg).without_indexer()
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Preset;

    #[test]
    fn every_member_survives_its_config_json_and_keeps_its_switches() {
        for f in SynthFamily::ALL {
            let cfg = f.apply(Preset::Tiny.config());
            cfg.validate().unwrap();
            let back = Glm5Config::from_hf_json(&cfg.to_hf_json().to_string()).unwrap();
            assert_eq!(back, cfg, "{}", f.name());
        }
        let v3 = SynthFamily::DeepseekV3.apply(Preset::Tiny.config());
        assert_eq!((v3.n_group, v3.topk_group), (4, 2), "8 experts, top-2");
        assert!(!v3.has_dsa());
        let lite = SynthFamily::DeepseekV2Lite.apply(Preset::Tiny.config());
        assert!(!lite.has_q_lora() && !lite.topk_method.has_bias());
        let v2 = SynthFamily::DeepseekV2.apply(Preset::Tiny.config());
        assert_eq!(
            (v2.n_group, v2.topk_group),
            (4, 1),
            "top-2 from the best group of 2"
        );
    }
}
