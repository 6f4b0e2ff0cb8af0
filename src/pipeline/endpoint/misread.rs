//! `--explain`'s config hypotheses: keys of the model's configuration a loader could have read
//! wrong, each as the value it would then run with. A loader that misses a key falls back to
//! its own default (transformers' `DeepseekV3Config` and GGUF loaders that skip a metadata key
//! default `rms_norm_eps` to 1e-6, `rope_theta` to 10000, no routed scaling), one that reuses
//! another model's code takes that model's choices (DeepSeek-V3's 8 expert groups, 4 used), and
//! a boolean can be read inverted. Each runs the reference with the one key changed.

use crate::model::config::Glm5Config;

/// One key read wrong: its name as the report shows it (`config rope_theta=10000`) and the
/// configuration the server would then run.
pub struct Misread {
    pub name: String,
    pub cfg: Glm5Config,
}

/// DeepSeek-V3's expert groups: 8 groups, the best 4 used.
const DEEPSEEK_GROUPS: (u64, u64) = (8, 4);

/// Every misread that changes `cfg` and leaves a configuration that can run, the likeliest
/// first: the defaults of a missed key, then another model's choices, then inversions.
pub fn misreads(cfg: &Glm5Config) -> Vec<Misread> {
    let mut out = Vec::new();
    let mut push = |key: &str, value: String, change: &dyn Fn(&mut Glm5Config)| {
        let mut changed = cfg.clone();
        change(&mut changed);
        if changed != *cfg && changed.validate().is_ok() {
            out.push(Misread {
                name: format!("config {key}={value}"),
                cfg: changed,
            });
        }
    };
    let eps = if cfg.rms_norm_eps == 1e-6 { 1e-5 } else { 1e-6 };
    push("rms_norm_eps", format!("{eps:e}"), &|c| {
        c.rms_norm_eps = eps
    });
    push("rope_theta", "10000".into(), &|c| c.rope_theta = 10000.0);
    push("routed_scaling_factor", "1".into(), &|c| {
        c.routed_scaling_factor = 1.0
    });
    if cfg.yarn.is_some() {
        push("rope_scaling", "none".into(), &|c| c.yarn = None);
    }
    let (groups, used) = if cfg.n_group == 1 {
        DEEPSEEK_GROUPS
    } else {
        (1, 1)
    };
    let groups_fit = cfg.n_routed_experts.is_multiple_of(groups)
        && cfg.num_experts_per_tok <= used * (cfg.n_routed_experts / groups);
    if groups_fit {
        push("n_group,topk_group", format!("{groups},{used}"), &|c| {
            (c.n_group, c.topk_group) = (groups, used)
        });
    }
    let inverted = !cfg.norm_topk_prob;
    push("norm_topk_prob", inverted.to_string(), &|c| {
        c.norm_topk_prob = inverted
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glm5s_misreads_are_the_fallbacks_and_deepseeks_groups() {
        let names: Vec<String> = misreads(&Glm5Config::glm5())
            .into_iter()
            .map(|m| m.name)
            .collect();
        assert_eq!(
            names,
            vec![
                "config rms_norm_eps=1e-6",
                "config rope_theta=10000",
                "config routed_scaling_factor=1",
                "config n_group,topk_group=8,4",
                "config norm_topk_prob=false",
            ]
        );
    }

    #[test]
    fn keys_already_at_the_fallback_and_groups_that_cannot_fit_are_left_out() {
        let mut cfg = Glm5Config::glm5();
        cfg.rope_theta = 10000.0;
        cfg.routed_scaling_factor = 1.0;
        cfg.n_routed_experts = 12;
        cfg.num_experts_per_tok = 2;
        let m = misreads(&cfg);
        let names: Vec<&str> = m.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(
            names,
            vec!["config rms_norm_eps=1e-6", "config norm_topk_prob=false"]
        );
        assert_eq!(m[0].cfg.rms_norm_eps, 1e-6);
        assert_eq!(m[0].cfg.rope_theta, 10000.0);
    }
}
