//! The MoE block: sigmoid (or softmax) routing with the correction bias used for the choice
//! only, group limits, normalisation and the routed scaling factor; the chosen experts run on
//! the tokens that chose them (split along the intermediate dimension under TP, whole on their
//! owning rank under EP); the shared expert; one all-reduce of each rank's partial sums.

use anyhow::Result;
use rayon::prelude::*;

use super::Layer;
use crate::exec::attention::NO_BOUNDARY;
use crate::exec::backend::{Backend, MlpJob, WeightedRows};
use crate::exec::mat::{Mat, Queue};
use crate::exec::ops::op_clock::Op;
use crate::exec::ops::{sigmoid, softmax, topk};
use crate::exec::real::Real;
use crate::exec::source::lazy_weight::LazyWeight;
use crate::exec::source::sharder::Sharder;
use crate::exec::source::WeightSource;
use crate::model::names::LayerWeight::*;
use crate::model::names::WeightId;
use crate::shard::plan::expert_rank;
use crate::trace::writer::OwnedStage;

impl<B: Backend> Layer<'_, B> {
    pub(super) fn moe(&mut self, x: &Mat<B::E>) -> Result<Mat<B::E>> {
        let cfg = &self.src.cfg;
        let (t, h) = (self.t, cfg.hidden_size as usize);
        let e = cfg.n_routed_experts as usize;
        let (be, tp) = (self.be, self.opts.tp);
        let logits = be.linear_exact(x, &*self.matrix(Router)?)?;
        self.rec_mat("moe.router_logits", &[t, e], "t e", &logits)?;
        // Engines keep the expert-choice bias in f32, as the checkpoint stores it; a router
        // without one (DeepSeek-V2) chooses by the scores alone.
        let bias = match cfg.topk_method.has_bias() {
            true => be.hold_exact(self.src.vector(self.w(RouterBias))?),
            false => vec![B::E::lit(0.0); e],
        };
        let hooks = self.src.hooks();
        let softmax = hooks.router_softmax(&cfg.scoring_func);
        let group_best = hooks.group_rank_scores(cfg.topk_method);
        let (ties, l, start) = (self.opts.ties, self.l, self.start);
        // The logits come back (once, where the backend left them on its device) while the
        // device runs the shared expert, which needs no routing: the host's routing overlaps
        // work queued there, where waiting for the logits alone would leave the device idle.
        let scores = logits.values_later(Queue::Forward)?;
        let (shared_whole, shared) = if cfg.n_shared_experts > 0 {
            self.mlp_parts(x, SharedGate, SharedUp, SharedDown)?
        } else {
            (Mat::zeros(t, h), vec![Mat::zeros(t, h); tp])
        };
        let scores = scores()?;
        let routes: Vec<_> = be.host(Op::Route, || {
            scores
                .par_chunks(e.max(1))
                .enumerate()
                .map(|(s, row)| {
                    let tie = ties.and_then(|ties| ties.moe_at(l, start + s));
                    route(cfg, (softmax, group_best), row, &bias, tie)
                })
                .collect()
        });
        let (mut ids, mut weights, mut gaps) = (
            Vec::with_capacity(t),
            Vec::with_capacity(t),
            Vec::with_capacity(t),
        );
        for (i, w, gap) in routes {
            ids.push(i);
            weights.push(w);
            gaps.push(gap);
        }
        let k = cfg.num_experts_per_tok as usize;
        let flat_ids: Vec<i32> = ids.iter().flatten().map(|&i| i as i32).collect();
        self.rec_owned("moe.topk_ids", &[t, k], "t k", OwnedStage::I32(flat_ids))?;
        let flat_w: Vec<B::E> = weights.iter().flatten().copied().collect();
        self.rec("moe.topk_weights", &[t, k], "t k", B::E::stage(&flat_w))?;
        self.rec("moe.topk_gap", &[t], "t", B::E::stage(&gaps))?;
        let sharder = self.sharder();
        // The expert `nan-expert` poisons: the first the first token chooses.
        let poisoned = self
            .src
            .hooks()
            .poisons_expert(cfg, self.l)
            .then(|| ids[0][0]);
        let mut routed: Vec<Option<Mat<B::E>>> = vec![None; tp];
        let mut used: Vec<usize> = ids.iter().flatten().copied().collect();
        used.sort_unstable();
        used.dedup();
        if be.reads_ahead() {
            self.src.read_ahead_experts(self.l, &used);
        }
        // Experts run a group at a time (a few on the CPU's cores, more in one GPU trip);
        // their outputs are added in expert order, so the sum depends on neither the group size
        // nor the thread count. Ranks in processes of their own must issue their collectives in
        // one order: one expert at a time there.
        let across_processes = be.collectives_across_processes();
        let at_once = if across_processes {
            1
        } else {
            be.experts_at_once()
        };
        let (src, l) = (self.src, self.l);
        let kept = |e: usize| {
            [ExpertsGate, ExpertsUp, ExpertsDown]
                .into_iter()
                .all(|which| {
                    let id = WeightId::Expert {
                        layer: l,
                        expert: e as u64,
                        which,
                    };
                    src.keeps(be, id)
                })
        };
        let joins = be.kept_experts_join_any_group() && !across_processes;
        let by_expert = be.host(Op::ExpertInputs, || rows_by_expert(e, (&ids, &weights)));
        let groups = groups_of(
            &used,
            at_once,
            |e| joins && kept(e),
            |e| by_expert.get(e).map_or(0, Vec::len),
        );
        for group in &groups {
            let mut outputs = routed_experts(self.src, be, self.l, group, x, &by_expert, sharder)?;
            if let Some(i) = group.iter().position(|&e| poisoned == Some(e)) {
                outputs[i].parts[0].1.data_mut()[0] = <B::E as num_traits::Float>::nan();
            }
            for (rank, sum) in routed.iter_mut().enumerate() {
                let mine: Vec<WeightedRows<'_, B::E>> = outputs
                    .iter()
                    .flat_map(|out| {
                        let rows = out.rows.as_slice();
                        out.parts
                            .iter()
                            .filter(move |(r, _)| *r == rank)
                            .map(move |(_, y)| (rows, y))
                    })
                    .collect();
                if !mine.is_empty() {
                    *sum = Some(be.on_rank(rank).add_weighted(sum.take(), (t, h), &mine)?);
                }
            }
        }
        let mut routed: Vec<Mat<B::E>> = routed
            .into_iter()
            .map(|sum| sum.unwrap_or_else(|| Mat::zeros(t, h)))
            .collect();
        if self.src.hooks().routed_scale_again() {
            let factor = B::E::lit(cfg.routed_scaling_factor);
            routed
                .iter_mut()
                .for_each(|p| p.data_mut().iter_mut().for_each(|v| *v *= factor));
        }
        let routed: Vec<Mat<B::E>> = routed
            .into_iter()
            .enumerate()
            .map(|(rank, p)| be.on_rank(rank).rounded(p))
            .collect::<Result<_>>()?;
        let routed_whole = be.all_reduce(&routed)?;
        self.rec_parts("moe.routed", &routed_whole, &routed, &[], "t d partial(tp)")?;
        self.rec_parts("moe.shared", &shared_whole, &shared, &[], "t d partial(tp)")?;
        if tp == 1 {
            return be.add(&routed[0], &shared_whole);
        }
        // One all-reduce of each rank's routed and shared partial sums, as vLLM's FusedMoE.
        let per_rank: Vec<Mat<B::E>> = routed
            .iter()
            .zip(&shared)
            .map(|(r, s)| be.add(r, s))
            .collect::<Result<_>>()?;
        be.all_reduce(&per_rank)
    }
}

/// One routed expert's work: the tokens that chose it with their routing weights, and its
/// output row for each.
struct ExpertOutput<E> {
    rows: Vec<(usize, E)>,
    /// The ranks computing it with their partial outputs: every rank its part of the
    /// intermediate dimension under TP, the owning rank the whole expert under EP.
    parts: Vec<(usize, Mat<E>)>,
}

/// Per expert of `experts`, the tokens that chose it in token order, each with its routing
/// weight (a token listing an expert twice, as a reference's tie-break might, counts its first
/// weight once): one pass over the choices.
fn rows_by_expert<E: Real>(
    experts: usize,
    (ids, weights): (&[Vec<usize>], &[Vec<E>]),
) -> Vec<Vec<(usize, E)>> {
    let mut rows: Vec<Vec<(usize, E)>> = vec![Vec::new(); experts];
    for (s, (ids, weights)) in ids.iter().zip(weights).enumerate() {
        for (&e, &w) in ids.iter().zip(weights) {
            let Some(expert) = rows.get_mut(e) else {
                continue;
            };
            if expert.last().is_none_or(|&(last, _)| last != s) {
                expert.push((s, w));
            }
        }
    }
    rows
}

/// Routed rows a group's experts that cost no weights' memory may bring it to: a group's
/// inputs, intermediates and outputs grow with its rows (about 300 MB for 8192 rows at GLM-5's
/// widths in bf16), and a long prompt's layer routes tens of thousands.
const GROUP_ROWS: usize = 8192;

/// `used` experts in order, cut into groups: at most `at_once` experts that `free` does not
/// name (each holds its dequantized weights while its group runs); those it names join the open
/// group while its routed rows (`rows` of each expert) stay within [`GROUP_ROWS`].
fn groups_of(
    used: &[usize],
    at_once: usize,
    free: impl Fn(usize) -> bool,
    rows: impl Fn(usize) -> usize,
) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let (mut counted, mut held) = (0, 0);
    for &e in used {
        let (costs, r) = (!free(e), rows(e));
        let fits = if costs {
            counted < at_once.max(1)
        } else {
            held + r <= GROUP_ROWS
        };
        match groups.last_mut() {
            Some(group) if fits => group.push(e),
            _ => {
                groups.push(vec![e]);
                (counted, held) = (0, 0);
            }
        }
        counted += usize::from(costs);
        held += r;
    }
    groups
}

/// Routed experts `group` on the tokens that chose each. Under TP each is split along the
/// intermediate dimension, every rank a partial output; otherwise each runs whole on its owning
/// rank (rank 0 without EP), each rank's experts in one [`Backend::mlps`] call.
fn routed_experts<B: Backend>(
    src: &WeightSource,
    be: &B,
    l: u64,
    group: &[usize],
    x: &Mat<B::E>,
    by_expert: &[Vec<(usize, B::E)>],
    sharder: Sharder,
) -> Result<Vec<ExpertOutput<B::E>>> {
    let weights_of = |e: usize| {
        [ExpertsGate, ExpertsUp, ExpertsDown].map(|role| LazyWeight::expert(src, l, e as u64, role))
    };
    let inputs: Vec<_> = be.host(Op::ExpertInputs, || {
        group
            .iter()
            .map(|&e| {
                let rows = by_expert.get(e).cloned().unwrap_or_default();
                let tokens: Vec<usize> = rows.iter().map(|&(s, _)| s).collect();
                (rows, tokens)
            })
            .collect()
    });
    if sharder.tp > 1 && !sharder.ep {
        // Split along the intermediate dimension, each expert's rows go to every rank.
        let xs: Vec<_> = be.host(Op::ExpertInputs, || {
            inputs
                .par_iter()
                .map(|(_, tokens)| x.gather_rows(tokens))
                .collect()
        });
        return group
            .par_iter()
            .zip(inputs)
            .zip(xs)
            .map(|((&e, (rows, _)), xs)| {
                let [gate, up, down] = weights_of(e);
                let y = crate::exec::tp::mlp_partials(be, &xs, [&gate, &up, &down], sharder)?;
                Ok(ExpertOutput {
                    rows,
                    parts: y.into_iter().enumerate().collect(),
                })
            })
            .collect();
    }
    let experts = src.cfg.n_routed_experts;
    let owners: Vec<usize> = group
        .iter()
        .map(|&e| expert_rank(e as u64, experts, sharder.tp as u64) as usize)
        .collect();
    let held = group
        .par_iter()
        .zip(&owners)
        .map(|(&e, &owner)| {
            let be = be.on_rank(owner);
            let [gate, up, down] = weights_of(e);
            Ok([gate.held(&be)?, up.held(&be)?, down.held(&be)?])
        })
        .collect::<Result<Vec<_>>>()?;
    let mut ranks = owners.clone();
    ranks.sort_unstable();
    ranks.dedup();
    let mut outputs: Vec<Option<Mat<B::E>>> = group.iter().map(|_| None).collect();
    for rank in ranks {
        let members: Vec<usize> = (0..group.len()).filter(|&i| owners[i] == rank).collect();
        let jobs: Vec<MlpJob<'_, B::Weight>> = members
            .iter()
            .map(|&i| {
                (
                    inputs[i].1.as_slice(),
                    [&*held[i][0], &*held[i][1], &*held[i][2]],
                )
            })
            .collect();
        for (i, y) in members.iter().zip(be.on_rank(rank).mlps(x, &jobs)?) {
            outputs[*i] = Some(y);
        }
    }
    Ok(inputs
        .into_iter()
        .zip(outputs)
        .zip(owners)
        .map(|(((rows, _), y), owner)| ExpertOutput {
            rows,
            parts: vec![(owner, y.expect("every member's output"))],
        })
        .collect())
}

/// One token's expert choice from its router logits: expert ids, their weights, and the choice
/// score of the k-th expert minus the best unchosen one (how close the choice came to a tie).
/// Scores are softmax or sigmoid; groups rank by the sum of their `group_best` best choice
/// scores (2 for `noaux_tc`, 1 for `group_limited_greedy`, 0: no group limit).
pub(crate) fn route<E: Real>(
    cfg: &crate::model::Glm5Config,
    (softmax_scores, group_best): (bool, usize),
    logits: &[E],
    bias: &[E],
    tie: Option<&[i32]>,
) -> (Vec<usize>, Vec<E>, E) {
    let scores: Vec<E> = if softmax_scores {
        let mut s = logits.to_vec();
        softmax(&mut s);
        s
    } else {
        logits.iter().map(|&v| sigmoid(v)).collect()
    };
    let mut choice: Vec<E> = scores.iter().zip(bias).map(|(&s, &b)| s + b).collect();
    let (groups, per) = (
        cfg.n_group as usize,
        cfg.n_routed_experts as usize / cfg.n_group as usize,
    );
    if groups > 1 && group_best > 0 {
        // Only the best `topk_group` groups compete.
        let group_score: Vec<E> = choice
            .chunks(per)
            .map(|g| topk(g, group_best).iter().map(|&i| g[i]).sum())
            .collect();
        let keep = topk(&group_score, cfg.topk_group as usize);
        for (g, chunk) in choice.chunks_mut(per).enumerate() {
            if !keep.contains(&g) {
                chunk.iter_mut().for_each(|v| *v = E::neg_infinity());
            }
        }
    }
    let k = cfg.num_experts_per_tok as usize;
    let mut ids = topk(&choice, k + 1);
    let gap = match (ids.get(k - 1), ids.get(k)) {
        (Some(&a), Some(&b)) if choice[b].is_finite() => choice[a] - choice[b],
        _ => E::lit(NO_BOUNDARY),
    };
    ids.truncate(k);
    if let Some(reference) = tie {
        ids = reference.iter().map(|&i| i as usize).collect();
    }
    let mut w: Vec<E> = ids.iter().map(|&i| scores[i]).collect();
    if cfg.norm_topk_prob {
        let denom = w.iter().copied().sum::<E>() + E::lit(1e-20);
        w.iter_mut().for_each(|v| *v /= denom);
    }
    let factor = E::lit(cfg.routed_scaling_factor);
    w.iter_mut().for_each(|v| *v *= factor);
    (ids, w, gap)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups hold `at_once` experts that cost weights' memory, in order; free ones join the
    /// open group while its rows stay within `GROUP_ROWS`, and a free first one opens it.
    #[test]
    fn free_experts_join_the_open_group_within_its_rows() {
        let used = [1, 2, 3, 4, 5, 6, 7];
        let few = |_| 10;
        assert_eq!(
            groups_of(&used, 2, |_| false, few),
            vec![vec![1, 2], vec![3, 4], vec![5, 6], vec![7]]
        );
        assert_eq!(groups_of(&used, 2, |_| true, few), vec![used.to_vec()]);
        assert_eq!(
            groups_of(&used, 2, |e| e % 2 == 1, few),
            vec![vec![1, 2, 3, 4, 5], vec![6, 7]]
        );
        assert_eq!(groups_of(&used, 0, |_| false, few).len(), 7);
        assert!(groups_of(&[], 4, |_| false, few).is_empty());
        // Free experts of half the rows each: two a group; one past the rows alone.
        let half = |_| GROUP_ROWS / 2;
        assert_eq!(
            groups_of(&used[..5], 2, |_| true, half),
            vec![vec![1, 2], vec![3, 4], vec![5]]
        );
        assert_eq!(
            groups_of(
                &[1, 2, 3],
                2,
                |_| true,
                |e| if e == 2 { GROUP_ROWS + 1 } else { 1 }
            ),
            vec![vec![1], vec![2], vec![3]]
        );
        // Experts that cost weights' memory are bounded by their count only: `at_once` a
        // group, whatever their rows.
        for at_once in 1..5 {
            for n in 0..12 {
                let used: Vec<usize> = (0..n).map(|e| 3 * e).collect();
                let chunks: Vec<Vec<usize>> = used.chunks(at_once).map(<[_]>::to_vec).collect();
                assert_eq!(groups_of(&used, at_once, |_| false, half), chunks);
            }
        }
        assert_eq!(
            groups_of(&[1, 2, 3], 3, |_| false, |_| GROUP_ROWS),
            vec![vec![1, 2, 3]]
        );
    }

    /// Tokens in order, each with the weight it gave the expert; an expert a token lists twice
    /// gets the token once, with its first weight; an id past the experts is nobody's.
    #[test]
    fn each_expert_gets_the_tokens_that_chose_it_once_in_order() {
        let ids = vec![vec![2, 0], vec![0, 1], vec![1, 1], vec![7, 2]];
        let weights = vec![
            vec![0.5f32, 0.25],
            vec![0.125, 2.0],
            vec![3.0, 4.0],
            vec![9.0, 1.5],
        ];
        let rows = rows_by_expert(3, (&ids, &weights));
        assert_eq!(
            rows,
            vec![
                vec![(0, 0.25), (1, 0.125)],
                vec![(1, 2.0), (2, 3.0)],
                vec![(0, 0.5), (3, 1.5)],
            ]
        );
    }

    /// Values whose sums depend on their order in f32.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                (x % 20_011) as f32 / 7.0 - 1400.0 + 1e-3 * (x % 97) as f32
            })
            .collect()
    }

    #[test]
    fn the_weighted_sum_adds_each_tokens_experts_in_their_order() {
        let (tokens, width) = (5, 7);
        // Three experts, tokens chosen by several of them, added to a sum already there.
        let expert = |rows: Vec<(usize, f32)>, seed: u32| {
            let y = Mat::new(rows.len(), width, values(rows.len() * width, seed));
            (rows, y)
        };
        let outputs = [
            expert(vec![(0, 0.3), (2, 1.7), (4, 0.01)], 1),
            expert(vec![(2, 0.9), (3, 2.5)], 2),
            expert(vec![(0, 1.1), (2, 0.25), (3, 0.6), (4, 3.0)], 3),
        ];
        let weighted: Vec<WeightedRows<'_, f32>> = outputs
            .iter()
            .map(|(rows, y)| (rows.as_slice(), y))
            .collect();
        let be = crate::exec::backend::Cpu::<f32>::new(crate::dtype::Precision::F32);
        let bits = |m: &Mat<f32>| m.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // Onto a sum already there, and onto zeros (None).
        for start in [
            Some(Mat::new(tokens, width, values(tokens * width, 9))),
            None,
        ] {
            // One thread, experts in order, rows in order.
            let mut want = start.clone().unwrap_or_else(|| Mat::zeros(tokens, width));
            for (rows, y) in &outputs {
                for (r, &(s, w)) in rows.iter().enumerate() {
                    let row = want.row_mut(s);
                    row.iter_mut().zip(y.row(r)).for_each(|(o, &v)| *o += w * v);
                }
            }
            let got = be.add_weighted(start, (tokens, width), &weighted).unwrap();
            assert_eq!(bits(&got), bits(&want));
        }
    }
}
