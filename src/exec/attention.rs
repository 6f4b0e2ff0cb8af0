//! MLA attention with the DSA lightning indexer, over a KV cache so that generation feeds one
//! token at a time.
//!
//! The cache keeps per layer what later positions attend to: the up-projected `kv` rows
//! (`[k_nope | v]` per head), the rotated shared `k_rope`, and the indexer's rotated keys.
//! Positions are absolute; a forward over new tokens starts at the cache's length.

use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{anyhow, bail, Context, Result};

use crate::dtype::Precision;
use crate::exec::backend::{Backend, Cpu, HeadCut};
use crate::exec::mat::{Mat, Queue};
use crate::exec::ops::attention_core::AttentionInputs;
use crate::exec::ops::indexer_core::IndexerInputs;
use crate::exec::ops::op_clock::Op;
use crate::exec::ops::topk;
use crate::exec::passes::Passes;
use num_traits::Float;
use rayon::prelude::*;

use crate::exec::ops::rope::{Rope, RotateSpec};
use crate::exec::ops::ties::TieBreaks;
use crate::exec::real::Real;
use crate::exec::source::lazy_weight::LazyWeight;
use crate::exec::source::sharder::{column_block, Sharder};
use crate::exec::source::WeightSource;
use crate::exec::tp::{column_parallel, concat_columns, row_parallel, WithParts};
use crate::model::config::IndexerKind;
use crate::model::names::{LayerWeight::*, WeightId};

/// The eps of the indexer's `k_norm` LayerNorm.
const INDEXER_NORM_EPS: f64 = 1e-6;

/// The gap recorded where no candidate lies beyond the top-k (all candidates were chosen).
pub const NO_BOUNDARY: f64 = -1.0;

/// Per query position, the key positions its DSA indexer chose (−1 past the causal edge).
pub type Selection = Vec<Vec<i32>>;

/// What earlier positions left for later ones, per layer.
pub struct KvCache<E> {
    pub layers: Vec<LayerCache<E>>,
}

pub struct LayerCache<E> {
    /// `[pos, heads·(nope+v)]`, a matrix a pass ([`Passes`]): each pass's kv projection output
    /// as it is (shared, not copied; left on a GPU that still holds it).
    kv: Vec<Mat<E>>,
    /// `[pos, rope]`, rotated, a matrix a pass.
    k_rope: Vec<Mat<E>>,
    /// `[pos, index_head_dim]`, normalised and rotated, a matrix a pass.
    index_k: Vec<Mat<E>>,
    len: usize,
}

impl<E> Default for KvCache<E> {
    fn default() -> Self {
        KvCache { layers: Vec::new() }
    }
}

impl<E> Default for LayerCache<E> {
    fn default() -> Self {
        LayerCache {
            kv: Vec::new(),
            k_rope: Vec::new(),
            index_k: Vec::new(),
            len: 0,
        }
    }
}

impl<E> KvCache<E> {
    /// Positions already processed.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn layer(&mut self, l: usize) -> &mut LayerCache<E> {
        if self.layers.len() <= l {
            self.layers.resize_with(l + 1, LayerCache::default);
        }
        &mut self.layers[l]
    }
}

/// The stages attention produces, for the caller to record.
pub struct AttentionOut<E> {
    /// The q LoRA's down-projection and its norm; None where the model has none.
    pub q_a: Option<(Mat<E>, Mat<E>)>,
    /// Before RoPE.
    pub q: Mat<E>,
    pub kv_a: Mat<E>,
    pub kv_a_norm: Mat<E>,
    pub kv: Mat<E>,
    /// Rotated parts in pair order: `[t, heads·rope]` and `[t, rope]`.
    pub q_rope: Mat<E>,
    pub k_rope: Mat<E>,
    /// The DSA indexer's choice for the new positions; None where the model has no indexer
    /// and every earlier position is attended.
    pub selection: Option<Chosen<E>>,
    /// `[t, heads·v]`.
    pub ctx: Mat<E>,
    pub out: Mat<E>,
    /// Per tensor-parallel rank (empty at TP 1): its heads of `q`, `kv` and `ctx`, and its
    /// partial `o_proj` output before the all-reduce.
    pub parts: RankParts<E>,
}

/// What each tensor-parallel rank computes of attention.
pub struct RankParts<E> {
    pub q: Vec<Mat<E>>,
    pub kv: Vec<Mat<E>>,
    pub ctx: Vec<Mat<E>>,
    pub out: Vec<Mat<E>>,
}

/// Where and how a layer's attention runs.
pub struct Step<'a, B> {
    pub src: &'a WeightSource,
    /// The layer.
    pub l: u64,
    /// Position of the first new token.
    pub start: usize,
    pub be: &'a B,
    /// Eps of the q_a/kv_a RMSNorms.
    pub latent_norm_eps: f64,
    /// Tensor-parallel ranks and the slices they hold.
    pub sharder: Sharder,
    pub ties: Option<&'a TieBreaks>,
}

impl<B> Clone for Step<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Step<'_, B> {}

/// Attention of layer `l` for the new rows `hn` (already `attn_norm`ed) at positions
/// `start..start+t`; `prev_selection` is the previous full layer's, for shared layers.
pub fn attention<B: Backend>(
    step: Step<'_, B>,
    hn: &Mat<B::E>,
    cache: &mut LayerCache<B::E>,
    prev_selection: Option<Chosen<B::E>>,
) -> Result<AttentionOut<B::E>> {
    let Step {
        src,
        l,
        start,
        be,
        latent_norm_eps,
        sharder,
        ..
    } = step;
    let (cfg, tp, hooks) = (&src.cfg, sharder.tp, src.hooks());
    let matrix = |role| src.matrix_in(be, WeightId::Layer(l, role));
    let vector = |role| src.vector_in(be, WeightId::Layer(l, role));
    let t = hn.rows;
    let (nh, nope, rope_d, vd) = (
        cfg.num_attention_heads as usize,
        cfg.qk_nope_head_dim as usize,
        cfg.qk_rope_head_dim as usize,
        cfg.v_head_dim as usize,
    );
    let (qk, kvl) = (nope + rope_d, cfg.kv_lora_rank as usize);
    // ColumnParallel up-projections: each rank its whole heads.
    let up = |x: &Mat<B::E>, role| -> Result<WithParts<B::E>> {
        if tp == 1 {
            return Ok((be.linear(x, &*matrix(role)?)?, Vec::new()));
        }
        let parts = column_parallel(be, x, &LazyWeight::layer(src, l, role), sharder)?;
        Ok((concat_columns(&parts), parts))
    };
    let q_a = match cfg.has_q_lora() {
        true => {
            let q_a = be.linear(hn, &*matrix(QA)?)?;
            let q_a_norm = be.rms_norm(&q_a, &vector(QANorm)?, latent_norm_eps)?;
            Some((q_a, q_a_norm))
        }
        false => None,
    };
    let (q, q_parts) = match &q_a {
        Some((_, q_a_norm)) => up(q_a_norm, QB)?,
        None => up(hn, QProj)?,
    };
    let kv_a = be.linear(hn, &*matrix(KvA)?)?;
    // kv_a's row: the latent, then the shared RoPE key (one head of the whole row).
    let kv_a_cut = |from, len| HeadCut {
        width: kv_a.cols,
        from,
        len,
    };
    let latent = be.head_columns(&kv_a, kv_a_cut(0, kvl))?;
    let kv_a_norm = be.rms_norm(&latent, &vector(KvANorm)?, latent_norm_eps)?;
    let (kv, kv_parts) = up(&kv_a_norm, KvB)?;

    let rope = Rope::new(cfg);
    let interleave = hooks.rope_interleave(cfg.rope_interleave);
    let k_rope = be.head_columns(&kv_a, kv_a_cut(kvl, rope_d))?;
    let spec = |width, offset| RotateSpec {
        width,
        offset,
        start,
        interleaved: interleave,
    };
    let k_rope = be.rope(&k_rope, &rope, spec(rope_d, 0))?;
    let q_rot = be.rope(&q, &rope, spec(qk, nope))?;
    let q_rope = be.head_columns(
        &q_rot,
        HeadCut {
            width: qk,
            from: nope,
            len: rope_d,
        },
    )?;
    let q_rot = be.rounded(q_rot)?;
    let k_rope = be.rounded(k_rope)?;
    be.host(Op::KvCache, || {
        cache.kv.push(kv.clone());
        cache.k_rope.push(k_rope.clone());
    });

    let choice = if !cfg.has_dsa() {
        None
    } else {
        match (cfg.indexer_types.get(l as usize), prev_selection) {
            (Some(IndexerKind::Shared), Some(prev)) => {
                Some(Chosen::Known(prev.selection()?.clone(), None))
            }
            (Some(IndexerKind::Shared), None) => {
                bail!("layer {l} shares the DSA selection but no earlier layer made one")
            }
            _ => {
                // `validate` refuses DSA without a q LoRA.
                let (_, q_a_norm) = q_a.as_ref().context("the DSA indexer needs the q LoRA")?;
                Some(indexer(step, hn, q_a_norm, cache, &rope)?)
            }
        }
    };
    cache.len += t;

    let total = start + t;
    let scale =
        B::E::lit(qk as f64).powf(B::E::lit(-0.5)) * B::E::lit(hooks.yarn_softmax_factor(cfg));
    // The keys each position sees: its DSA selection, else every position up to its own (the
    // same set where the indexer keeps them all; the attention reads keys in any order).
    let keys: Vec<Vec<i32>> = be.host(Op::AttentionKeys, || {
        (0..t)
            .map(|i| match &choice {
                Some(Chosen::Known(sel, _)) => sel[i].clone(),
                None | Some(Chosen::Ranking(_)) => (0..=(start + i) as i32).collect(),
            })
            .collect()
    });
    let ctx = be.attention(&AttentionInputs {
        q: &q_rot,
        kv: Passes(&cache.kv),
        k_rope: Passes(&cache.k_rope),
        keys: &keys,
        heads: nh,
        nope,
        rope: rope_d,
        v: vd,
        positions: total,
        scale,
    })?;
    let ctx = be.rounded(ctx)?;
    // RowParallel o_proj: each rank's heads give a partial output, all-reduced.
    let (out, ctx_parts, out_parts) = if tp == 1 {
        (be.linear(&ctx, &*matrix(AttnOut)?)?, Vec::new(), Vec::new())
    } else {
        let ctx_parts = (0..tp)
            .map(|r| column_block(&ctx, r, tp))
            .collect::<Result<Vec<_>>>()?;
        let o_proj = LazyWeight::layer(src, l, AttnOut);
        let (out, out_parts) = row_parallel(be, &ctx_parts, &o_proj, sharder)?;
        let out = hooks.attn_all_reduce(be, l, out, &out_parts)?;
        (out, ctx_parts, out_parts)
    };
    Ok(AttentionOut {
        q_a,
        q,
        kv_a,
        kv_a_norm,
        kv,
        q_rope,
        k_rope,
        selection: choice,
        ctx,
        out,
        parts: RankParts {
            q: q_parts,
            kv: kv_parts,
            ctx: ctx_parts,
            out: out_parts,
        },
    })
}

/// The DSA indexer's choice for the new positions, or a shared layer's reuse of an earlier one.
pub enum Chosen<E> {
    /// Per query, the causal top-`index_topk` key positions (−1 where fewer keys exist), and
    /// the score gap at the top-k boundary (none for a layer that shares an earlier choice).
    Known(Selection, Option<Vec<E>>),
    /// Every causal position kept (the cache holds no more than `index_topk`) and the scores
    /// left on a GPU: the attention needs no score, and the order by score, which the trace
    /// records (and a later layer sharing the choice reads), is ranked on a thread of its own
    /// from a copy of the scores that the forward does not wait for.
    Ranking(Ranking<E>),
}

impl<E> Chosen<E> {
    /// Per query, the chosen key positions: waited for where they are still being ranked.
    pub fn selection(&self) -> Result<&Selection> {
        match self {
            Chosen::Known(sel, _) => Ok(sel),
            Chosen::Ranking(ranking) => Ok(&ranking.get()?.0),
        }
    }
}

/// A layer's DSA ranking on its way from a thread of its own: shared by whoever reads it (the
/// trace's writer, a later layer), and waited for by the first of them.
pub struct Ranking<E>(Arc<RankingCell<E>>);

impl<E> Clone for Ranking<E> {
    fn clone(&self) -> Self {
        Ranking(self.0.clone())
    }
}

type Ranked<E> = (Selection, Vec<E>);

struct RankingCell<E> {
    l: u64,
    /// Choices a query: every row of the selection has this many.
    k: usize,
    coming: Mutex<Option<Receiver<Result<Ranked<E>>>>>,
    ranked: OnceLock<std::result::Result<Ranked<E>, String>>,
}

impl<E: Send + 'static> Ranking<E> {
    /// Layer `l`'s ranking of `k` choices a query, by `rank` on a thread of its own (it waits
    /// for the GPU, which no pool's worker should).
    fn on_thread(
        l: u64,
        k: usize,
        rank: impl FnOnce() -> Result<Ranked<E>> + Send + 'static,
    ) -> Result<Self> {
        let (sender, coming) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("dsa-ranking".into())
            .spawn(move || {
                // The forward may have stopped on an error meanwhile: then nobody waits.
                let _ = sender.send(rank());
            })?;
        Ok(Ranking(Arc::new(RankingCell {
            l,
            k,
            coming: Mutex::new(Some(coming)),
            ranked: OnceLock::new(),
        })))
    }
}

impl<E> Ranking<E> {
    /// The selection and the score gaps, once ranked.
    pub fn get(&self) -> Result<&Ranked<E>> {
        let cell = &*self.0;
        let ranked = cell.ranked.get_or_init(|| {
            let coming = cell.coming.lock().unwrap_or_else(|p| p.into_inner()).take();
            match coming.map(|c| c.recv()) {
                Some(Ok(Ok(ranked))) => Ok(ranked),
                Some(Ok(Err(e))) => Err(format!("{e:#}")),
                _ => Err("the DSA indexer's ranking stopped before its end".into()),
            }
        });
        ranked
            .as_ref()
            .map_err(|why| anyhow!("layer {}: {why}", cell.l))
    }

    /// Choices a query.
    pub fn k(&self) -> usize {
        self.0.k
    }
}

/// DSA lightning indexer for the new positions.
fn indexer<B: Backend>(
    step: Step<'_, B>,
    hn: &Mat<B::E>,
    q_a_norm: &Mat<B::E>,
    cache: &mut LayerCache<B::E>,
    rope: &Rope<B::E>,
) -> Result<Chosen<B::E>> {
    let Step {
        src, l, start, be, ..
    } = step;
    let cfg = &src.cfg;
    let rotation = IndexerRotation {
        interleaved: src
            .hooks()
            .indexer_rope_interleave(cfg.indexer_rope_interleave),
        rope_trailing: false,
    };
    let scores = indexer_scores(
        (be, src, l),
        (hn, q_a_norm),
        &mut cache.index_k,
        (rope, rotation, start),
    )?;
    let total = start + hn.rows;
    let k_sel = (cfg.index_topk as usize).min(total);
    if k_sel == total && step.ties.is_none() && !scores.on_host() {
        // A thread of its own: it waits for the GPU, which no pool's worker should.
        let scores = scores.values_later(Queue::Beside)?;
        let ranking = Ranking::on_thread(l, k_sel, move || {
            scores().map(|scores| rank(&scores, (start, total), k_sel, None, l))
        })?;
        return Ok(Chosen::Ranking(ranking));
    }
    let scores = scores.fetched()?;
    let ranked = || rank(scores, (start, total), k_sel, step.ties, l);
    let (selection, gaps) = be.host(Op::IndexerTopk, ranked);
    Ok(Chosen::Known(selection, Some(gaps)))
}

/// How the indexer rotates its query and key heads: in interleaved pairs or NeoX halves, on
/// each head's leading rope dims or (a layout bug) its trailing ones.
#[derive(Clone, Copy, Debug)]
pub struct IndexerRotation {
    pub interleaved: bool,
    pub rope_trailing: bool,
}

/// The indexer's `[t, positions]` scores of the new positions (`start`…) from the layer's
/// normed hidden state `hn` and q LoRA `q_a_norm`, their keys appended to `keys`.
fn indexer_scores<B: Backend>(
    (be, src, l): (&B, &WeightSource, u64),
    (hn, q_a_norm): (&Mat<B::E>, &Mat<B::E>),
    keys: &mut Vec<Mat<B::E>>,
    (rope, rotation, start): (&Rope<B::E>, IndexerRotation, usize),
) -> Result<Mat<B::E>> {
    let cfg = &src.cfg;
    let matrix = |role| src.matrix_in(be, WeightId::Layer(l, role));
    let vector = |role| src.vector_in(be, WeightId::Layer(l, role));
    let (ih, ihd) = (cfg.index_n_heads as usize, cfg.index_head_dim as usize);
    let q = be.linear(q_a_norm, &*matrix(IndexerQB)?)?;
    let k_lin = be.linear(hn, &*matrix(IndexerK)?)?;
    let k = be.layer_norm(
        &k_lin,
        &vector(IndexerKNorm)?,
        &vector(IndexerKNormBias)?,
        INDEXER_NORM_EPS,
    )?;
    let weights = be.linear(hn, &*matrix(IndexerProj)?)?;
    // The key is one head of `ihd`; the rope dims lead each head.
    let spec = RotateSpec {
        width: ihd,
        offset: match rotation.rope_trailing {
            true => ihd - cfg.qk_rope_head_dim as usize,
            false => 0,
        },
        start,
        interleaved: rotation.interleaved,
    };
    let k = be.rounded(be.rope(&k, rope, spec)?)?;
    let q = be.rounded(be.rope(&q, rope, spec)?)?;
    keys.push(k);
    let power = |n: usize| B::E::lit(n as f64).powf(B::E::lit(-0.5));
    be.indexer_scores(&IndexerInputs {
        q: &q,
        keys: Passes(keys),
        weights: &weights,
        heads: ih,
        dim: ihd,
        start,
        scale: power(ihd),
        head_scale: power(ih),
    })
}

/// For a diagnosis: the indexer of layer `l` choosing over a whole prompt from its inputs, in
/// f32 on the CPU, its rope as `rotation` says; with each position's gap between its k-th
/// score and the best unchosen one.
pub fn indexer_choices(
    src: &WeightSource,
    l: u64,
    (hn, q_a_norm): (&Mat<f32>, &Mat<f32>),
    rotation: IndexerRotation,
) -> Result<(Selection, Vec<f32>)> {
    let be = Cpu::new(Precision::F32);
    let rope = Rope::new(&src.cfg);
    let scores = indexer_scores(
        (&be, src, l),
        (hn, q_a_norm),
        &mut Vec::new(),
        (&rope, rotation, 0),
    )?;
    let t = hn.rows;
    let k_sel = (src.cfg.index_topk as usize).min(t);
    Ok(rank(scores.fetched()?, (0, t), k_sel, None, l))
}

/// Per query of `scores` (`[t, total]`, the first at position `start`), the causal top
/// `k_sel` positions (−1 where fewer exist; the reference's choice where `ties` holds one for
/// it), and the gap between the scores of the k-th choice and the best unchosen one. Queries
/// in parallel, each its own top-k.
fn rank<E: Real>(
    scores: &[E],
    (start, total): (usize, usize),
    k_sel: usize,
    ties: Option<&TieBreaks>,
    l: u64,
) -> (Selection, Vec<E>) {
    scores
        .par_chunks(total.max(1))
        .enumerate()
        .map(|(i, score)| {
            let p = start + i;
            let ranked = topk(&score[..=p], (k_sel + 1).min(p + 1));
            let gap = if p + 1 > k_sel {
                score[ranked[k_sel - 1]] - score[ranked[k_sel]]
            } else {
                E::lit(NO_BOUNDARY)
            };
            let mut chosen: Vec<i32> = ranked.into_iter().take(k_sel).map(|j| j as i32).collect();
            chosen.resize(k_sel, -1);
            if let Some(reference) = ties.and_then(|ties| ties.dsa_at(l, p)) {
                chosen = reference.to_vec();
            }
            (chosen, gap)
        })
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranking_is_shared_by_its_readers_and_its_failures_name_the_layer() {
        let ranking = Ranking::on_thread(3, 2, || {
            Ok((vec![vec![1, 0], vec![0, -1]], vec![0.5f32, -1.0]))
        })
        .unwrap();
        let (copy, later) = (ranking.clone(), Chosen::Ranking(ranking.clone()));
        let reader = std::thread::spawn(move || copy.get().unwrap().clone());
        assert_eq!(later.selection().unwrap(), &vec![vec![1, 0], vec![0, -1]]);
        assert_eq!(reader.join().unwrap(), ranking.get().unwrap().clone());
        assert_eq!(ranking.k(), 2);

        let failed = Ranking::<f32>::on_thread(4, 1, || bail!("device lost")).unwrap();
        let err = failed.get().unwrap_err().to_string();
        assert!(
            err.contains("layer 4") && err.contains("device lost"),
            "{err}"
        );
        let stopped =
            Ranking::<f32>::on_thread(5, 1, || panic!("the ranking's thread ends here")).unwrap();
        let err = stopped.get().unwrap_err().to_string();
        assert!(
            err.contains("layer 5") && err.contains("stopped before its end"),
            "{err}"
        );
        assert!(
            stopped.get().is_err(),
            "the failure is kept for every reader"
        );
    }
}
