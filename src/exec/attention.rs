//! MLA attention with the DSA lightning indexer, over a KV cache so that generation feeds one
//! token at a time.
//!
//! The cache keeps per layer what later positions attend to: the up-projected `kv` rows
//! (`[k_nope | v]` per head), the rotated shared `k_rope`, and the indexer's rotated keys.
//! Positions are absolute; a forward over new tokens starts at the cache's length.

use anyhow::{bail, Result};

use super::backend::Cpu;
use super::mat::Mat;
use super::ops::{rope, softmax, topk};
use super::source::WeightSource;
use crate::model::config::IndexerKind;
use crate::model::names::{LayerWeight, LayerWeight::*, WeightId};

/// The eps of the indexer's `k_norm` LayerNorm.
const INDEXER_NORM_EPS: f64 = 1e-6;

/// The gap recorded where no candidate lies beyond the top-k (all candidates were chosen).
pub const NO_BOUNDARY: f32 = -1.0;

/// What earlier positions left for later ones, per layer.
#[derive(Default)]
pub struct KvCache {
    pub layers: Vec<LayerCache>,
}

#[derive(Default)]
pub struct LayerCache {
    /// `[pos, heads·(nope+v)]`.
    kv: Vec<f32>,
    /// `[pos, rope]`, rotated.
    k_rope: Vec<f32>,
    /// `[pos, index_head_dim]`, normalised and rotated.
    index_k: Vec<f32>,
    len: usize,
}

impl KvCache {
    /// Positions already processed.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, |l| l.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn layer(&mut self, l: usize) -> &mut LayerCache {
        if self.layers.len() <= l {
            self.layers.resize_with(l + 1, LayerCache::default);
        }
        &mut self.layers[l]
    }
}

/// The stages attention produces, for the caller to record.
pub struct AttentionOut {
    pub q_a: Mat,
    pub q_a_norm: Mat,
    /// Before RoPE.
    pub q: Mat,
    pub kv_a: Mat,
    pub kv_a_norm: Mat,
    pub kv: Mat,
    /// Rotated parts in pair order: `[t, heads·rope]` and `[t, rope]`.
    pub q_rope: Vec<f32>,
    pub k_rope: Mat,
    /// Per new position, the chosen absolute key positions (−1 past the causal edge).
    pub selection: Vec<Vec<i32>>,
    /// Per new position, indexer score of the k-th choice minus the best unchosen one.
    pub selection_gap: Option<Vec<f32>>,
    pub ctx: Vec<f32>,
    pub out: Mat,
}

/// Where and how a layer's attention runs.
#[derive(Clone, Copy)]
pub struct Step<'a> {
    pub src: &'a WeightSource,
    /// The layer.
    pub l: u64,
    /// Position of the first new token.
    pub start: usize,
    pub be: Cpu,
    /// Eps of the q_a/kv_a RMSNorms.
    pub latent_norm_eps: f64,
}

/// Attention of layer `l` for the new rows `hn` (already `attn_norm`ed) at positions
/// `start..start+t`; `prev_selection` is the previous full layer's, for shared layers.
pub fn attention(
    step: Step<'_>,
    hn: &Mat,
    cache: &mut LayerCache,
    prev_selection: Option<Vec<Vec<i32>>>,
) -> Result<AttentionOut> {
    let Step {
        src,
        l,
        start,
        be,
        latent_norm_eps,
    } = step;
    let cfg = &src.cfg;
    let w = |role: LayerWeight| WeightId::Layer(l, role);
    let t = hn.rows;
    let (nh, nope, rope_d, vd) = (
        cfg.num_attention_heads as usize,
        cfg.qk_nope_head_dim as usize,
        cfg.qk_rope_head_dim as usize,
        cfg.v_head_dim as usize,
    );
    let (qk, kvl) = (nope + rope_d, cfg.kv_lora_rank as usize);
    let q_a = be.linear(hn, &src.matrix(w(QA))?)?;
    let q_a_norm = be.rms_norm(&q_a, &src.vector(w(QANorm))?, latent_norm_eps);
    let q = be.linear(&q_a_norm, &src.matrix(w(QB))?)?;
    let kv_a = be.linear(hn, &src.matrix(w(KvA))?)?;
    let kv_a_norm = be.rms_norm(
        &kv_a.columns(0, kvl),
        &src.vector(w(KvANorm))?,
        latent_norm_eps,
    );
    let kv = be.linear(&kv_a_norm, &src.matrix(w(KvB))?)?;

    let freqs = super::ops::inv_freq(cfg.rope_theta, rope_d);
    let mut q_rot = q.clone();
    let mut k_rope = kv_a.columns(kvl, rope_d);
    for i in 0..t {
        rope(k_rope.row_mut(i), start + i, &freqs, cfg.rope_interleave);
        for head in q_rot.row_mut(i).chunks_exact_mut(qk) {
            rope(&mut head[nope..], start + i, &freqs, cfg.rope_interleave);
        }
    }
    let q_rope: Vec<f32> = q_rot
        .data
        .chunks_exact(qk)
        .flat_map(|hd| hd[nope..].to_vec())
        .collect();
    be.round(&mut q_rot.data);
    be.round(&mut k_rope.data);
    cache.kv.extend_from_slice(&kv.data);
    cache.k_rope.extend_from_slice(&k_rope.data);

    let (selection, selection_gap) = match (cfg.indexer_types.get(l as usize), prev_selection) {
        (Some(IndexerKind::Shared), Some(prev)) => (prev, None),
        (Some(IndexerKind::Shared), None) => {
            bail!("layer {l} shares the DSA selection but no earlier layer made one")
        }
        _ => {
            let (sel, gap) = indexer(step, hn, &q_a_norm, cache, &freqs)?;
            (sel, Some(gap))
        }
    };
    cache.len += t;

    let total = start + t;
    let scale = (qk as f32).powf(-0.5);
    let row = |width: usize, j: usize| j * width..(j + 1) * width;
    let mut ctx = vec![0f32; t * nh * vd];
    let mut probs = vec![0f32; total];
    for head in 0..nh {
        for (i, chosen) in selection.iter().enumerate() {
            let p = start + i;
            let qh = &q_rot.row(i)[head * qk..(head + 1) * qk];
            probs.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            for j in chosen.iter().filter(|&&j| j >= 0).map(|&j| j as usize) {
                let kvj = &cache.kv[row(nh * (nope + vd), j)][head * (nope + vd)..];
                let kr = &cache.k_rope[row(rope_d, j)];
                let dot_nope: f32 = qh[..nope]
                    .iter()
                    .zip(&kvj[..nope])
                    .map(|(a, b)| a * b)
                    .sum();
                let dot_rope: f32 = qh[nope..].iter().zip(kr).map(|(a, b)| a * b).sum();
                probs[j] = (dot_nope + dot_rope) * scale;
            }
            softmax(&mut probs[..=p]);
            let out = &mut ctx[(i * nh + head) * vd..][..vd];
            for (j, &pr) in probs[..=p].iter().enumerate().filter(|(_, pr)| **pr != 0.0) {
                let v = &cache.kv[row(nh * (nope + vd), j)][head * (nope + vd) + nope..][..vd];
                out.iter_mut().zip(v).for_each(|(o, vv)| *o += pr * vv);
            }
        }
    }
    be.round(&mut ctx);
    let out = be.linear(&Mat::new(t, nh * vd, ctx.clone()), &src.matrix(w(AttnOut))?)?;
    Ok(AttentionOut {
        q_a,
        q_a_norm,
        q,
        kv_a,
        kv_a_norm,
        kv,
        q_rope,
        k_rope,
        selection,
        selection_gap,
        ctx,
        out,
    })
}

/// DSA lightning indexer for the new positions: per query, the causal top-`index_topk` key
/// positions (−1 where fewer keys exist), and the score gap at the top-k boundary.
fn indexer(
    step: Step<'_>,
    hn: &Mat,
    q_a_norm: &Mat,
    cache: &mut LayerCache,
    freqs: &[f32],
) -> Result<(Vec<Vec<i32>>, Vec<f32>)> {
    let Step {
        src, l, start, be, ..
    } = step;
    let cfg = &src.cfg;
    let w = |role: LayerWeight| WeightId::Layer(l, role);
    let t = hn.rows;
    let (ih, ihd, rope_d) = (
        cfg.index_n_heads as usize,
        cfg.index_head_dim as usize,
        cfg.qk_rope_head_dim as usize,
    );
    let mut q = be.linear(q_a_norm, &src.matrix(w(IndexerQB))?)?;
    let k_lin = be.linear(hn, &src.matrix(w(IndexerK))?)?;
    let mut k = be.layer_norm(
        &k_lin,
        &src.vector(w(IndexerKNorm))?,
        &src.vector(w(IndexerKNormBias))?,
        INDEXER_NORM_EPS,
    );
    let weights = be.linear(hn, &src.matrix(w(IndexerProj))?)?;
    for i in 0..t {
        rope(
            &mut k.row_mut(i)[..rope_d],
            start + i,
            freqs,
            cfg.indexer_rope_interleave,
        );
        for head in q.row_mut(i).chunks_exact_mut(ihd) {
            rope(
                &mut head[..rope_d],
                start + i,
                freqs,
                cfg.indexer_rope_interleave,
            );
        }
    }
    be.round(&mut k.data);
    be.round(&mut q.data);
    cache.index_k.extend_from_slice(&k.data);
    let total = start + t;
    let (scale, head_scale) = ((ihd as f32).powf(-0.5), (ih as f32).powf(-0.5));
    let k_sel = (cfg.index_topk as usize).min(total);
    let (mut selection, mut gaps) = (Vec::with_capacity(t), Vec::with_capacity(t));
    for i in 0..t {
        let p = start + i;
        let mut score = vec![f32::NEG_INFINITY; total];
        for (j, sc) in score.iter_mut().enumerate().take(p + 1) {
            let key = &cache.index_k[j * ihd..(j + 1) * ihd];
            *sc = (0..ih)
                .map(|head| {
                    let dot: f32 = q.row(i)[head * ihd..(head + 1) * ihd]
                        .iter()
                        .zip(key)
                        .map(|(a, b)| a * b)
                        .sum();
                    weights.row(i)[head] * head_scale * (dot * scale).max(0.0)
                })
                .sum();
        }
        let ranked = topk(&score[..=p], (k_sel + 1).min(p + 1));
        gaps.push(if p + 1 > k_sel {
            score[ranked[k_sel - 1]] - score[ranked[k_sel]]
        } else {
            NO_BOUNDARY
        });
        let mut chosen: Vec<i32> = ranked.into_iter().take(k_sel).map(|j| j as i32).collect();
        chosen.resize(k_sel, -1);
        selection.push(chosen);
    }
    Ok((selection, gaps))
}
