//! Another expert choice, told apart: the reference's own router logits routed again the ways a
//! router commonly goes wrong — scores by the other function, the expert-group limit left out or
//! its groups ranked by the other rule, the correction bias left out. A way that gives the
//! candidate's choice at every position names what the candidate's router does; the ids it is
//! held to are kept whole by every probe's default recording.

use anyhow::Result;

use super::choice::{divergent_fault, named_together, Choices, Fit};
use crate::compare::stage_diff::whole_values;
use crate::compare::{DiffReport, FaultClass};
use crate::exec::faults::hooks::Hooks;
use crate::exec::forward::route;
use crate::exec::ops::ties::TieBreaks;
use crate::exec::source::WeightSource;
use crate::model::config::TopkMethod;
use crate::model::names::{LayerWeight, WeightId};
use crate::model::{Glm5Config, Stage};
use crate::trace::Trace;

/// One way of routing: what it changes, in words, and its switches.
struct Way {
    what: String,
    softmax: bool,
    group_best: usize,
    bias: bool,
}

/// The ways `cfg`'s router can go wrong that change a choice, its own way first.
fn ways(cfg: &Glm5Config) -> Vec<Way> {
    let softmax = cfg.scoring_func == "softmax";
    let group_best = Hooks::new(None).group_rank_scores(cfg.topk_method);
    let has_bias = cfg.topk_method.has_bias();
    let own = |what: String| Way {
        what,
        softmax,
        group_best,
        bias: has_bias,
    };
    let mut ways = vec![own("the configured router".into())];
    ways.push(Way {
        softmax: !softmax,
        ..own(match softmax {
            true => "sigmoid scores where the model takes softmax".into(),
            false => "softmax scores where the model takes sigmoid".into(),
        })
    });
    if cfg.n_group > 1 && cfg.topk_group < cfg.n_group && group_best > 0 {
        ways.push(Way {
            group_best: 0,
            ..own(format!(
                "every expert group competing: the group limit (the best {} of {} groups) left \
                 out",
                cfg.topk_group, cfg.n_group
            ))
        });
        ways.push(Way {
            group_best: 3 - group_best,
            ..own(match cfg.topk_method {
                TopkMethod::NoauxTc => {
                    "groups ranked by their best score where the model sums their two best".into()
                }
                _ => "groups ranked by the sum of their two best scores where the model takes \
                      their best"
                    .into(),
            })
        });
    }
    if has_bias {
        ways.push(Way {
            bias: false,
            ..own("the correction bias (e_score_correction_bias) left out of the choice".into())
        });
    }
    ways
}

/// Add to a `router_mismatch` at `L{n}.moe.topk_ids` (or at its `topk_weights`, where a lower
/// precision left the ids unjudged) the way of routing that gives the candidate's choices,
/// where one does: in the summary when the traces alone classed the fault (`rename`), else as
/// evidence beside the cause a setting or a weight already names.
pub fn explain_choice(
    src: &WeightSource,
    (reference, candidate): (&Trace, &Trace),
    report: &mut DiffReport,
    (rename, ties): (bool, Option<&TieBreaks>),
) -> Result<()> {
    let kinds = ["moe.topk_ids", "moe.topk_weights"];
    let Some((l, fault)) = divergent_fault(report, &kinds, FaultClass::RouterMismatch) else {
        return Ok(());
    };
    let ids_stage = Stage::layer_stage(l, "moe.topk_ids").to_string();
    let cfg = &src.cfg;
    let logits_stage = Stage::layer_stage(l, "moe.router_logits").to_string();
    let (Some((logits, shape)), Some((ours, _)), Some((theirs, their_shape))) = (
        whole_values(reference, &logits_stage)?,
        whole_values(reference, &ids_stage)?,
        whole_values(candidate, &ids_stage)?,
    ) else {
        return Ok(());
    };
    let (e, k) = (
        cfg.n_routed_experts as usize,
        cfg.num_experts_per_tok as usize,
    );
    let t = shape.first().copied().unwrap_or(0) as usize;
    if shape != [t as u64, e as u64]
        || their_shape != [t as u64, k as u64]
        || ours.len() != t * k
        || t == 0
    {
        return Ok(());
    }
    let bias = match cfg.topk_method.has_bias() {
        true => src.vector(WeightId::Layer(l, LayerWeight::RouterBias))?,
        false => vec![0.0; e],
    };
    let zeros = vec![0.0f32; e];
    let choose = |way: &Way| {
        let bias = if way.bias { &bias } else { &zeros };
        let (ids, gaps) = (0..t)
            .map(|p| {
                let row = &logits[p * e..(p + 1) * e];
                let (ids, _, gap) = route(cfg, (way.softmax, way.group_best), row, bias, None);
                (ids.into_iter().map(|i| i as i64).collect(), gap)
            })
            .unzip();
        Choices { ids, gaps }
    };
    let reference_tie = |p: usize| ties.is_some_and(|t| t.moe_at(l, p).is_some());
    let near: Option<&dyn Fn(usize) -> bool> = ties.map(|_| &reference_tie as _);
    let all = ways(cfg);
    // The configured way must give the reference's own choices, else the logits are not read
    // as the router reads them.
    let own = choose(&all[0]);
    if !own.fit(&ours, k, near).holds(t) {
        return Ok(());
    }
    // A hypothesis counts where the configured choice cannot hold the candidate's, even at near
    // ties.
    let configured = own.fit(&theirs, k, near);
    if configured.holds(t) {
        return Ok(());
    }
    let fitting: Vec<(&str, Fit)> = all[1..]
        .iter()
        .map(|w| (w.what.as_str(), choose(w).fit(&theirs, k, near)))
        .filter(|(_, fit)| fit.holds(t))
        .collect();
    let names: Vec<&str> = fitting.iter().map(|(what, _)| *what).collect();
    let Some(what) = named_together(&names) else {
        return Ok(());
    };
    if rename {
        fault.summary = format!("{ids_stage}: the router chooses as with {what}");
    }
    fault.evidence.push(format!(
        "the reference's router logits at {logits_stage}, routed again with {what}, give the \
         candidate's choices at {} (the configured router's at {})",
        fitting[0].1.positions(t),
        configured.same
    ));
    Ok(())
}
