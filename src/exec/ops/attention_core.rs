//! The attention kernel's math, apart from the forward: what every backend computes for MLA
//! over the cache (the CPU's loops are the default of `Backend::attention`),
//! so that backends depend on it and not on the forward's attention step.

use rayon::prelude::*;

use crate::exec::mat::Mat;
use crate::exec::ops::softmax;
use crate::exec::passes::Passes;
use crate::exec::real::Real;

/// What MLA attention reads for a batch of new positions: their rotated queries `q` `[t, heads ·
/// (nope + rope)]`, the cache's `kv` rows `[positions, heads · (nope + v)]` (each head's
/// `k_nope` then `v`) and shared `k_rope` `[positions, rope]` as the passes added them, and the
/// keys each position may see (−1: none).
pub struct AttentionInputs<'a, E> {
    pub q: &'a Mat<E>,
    pub kv: Passes<'a, E>,
    pub k_rope: Passes<'a, E>,
    pub keys: &'a [Vec<i32>],
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub positions: usize,
    pub scale: E,
}

/// `softmax(q·kᵀ · scale) · v` per position and head, unrounded: the CPU's loops, positions in
/// parallel, each position's sums in one fixed order (each dot product as [`Real::dot`] sums
/// it: in f32 16 lanes, not one chain of dependent adds).
pub fn attention_core<E: Real>(a: &AttentionInputs<'_, E>) -> Vec<E> {
    let (nh, nope, rope_d, vd) = (a.heads, a.nope, a.rope, a.v);
    let qk = nope + rope_d;
    let (kv_rows, k_rope_rows) = (a.kv.rows(), a.k_rope.rows());
    let mut ctx = vec![E::zero(); a.q.rows * nh * vd];
    ctx.par_chunks_mut(nh * vd)
        .enumerate()
        .for_each(|(i, ctx_i)| {
            let mut probs = vec![E::zero(); a.positions];
            for (head, out) in ctx_i.chunks_exact_mut(vd).enumerate() {
                let qh = &a.q.row(i)[head * qk..(head + 1) * qk];
                probs.iter_mut().for_each(|v| *v = E::neg_infinity());
                let seen = a.keys[i].iter().filter(|&&j| j >= 0).map(|&j| j as usize);
                for j in seen.filter(|&j| j < a.positions.min(kv_rows.len()).min(k_rope_rows.len()))
                {
                    let kvj = &kv_rows[j][head * (nope + vd)..];
                    let kr = k_rope_rows[j];
                    let dot_nope = E::dot(&qh[..nope], &kvj[..nope]);
                    let dot_rope = E::dot(&qh[nope..], kr);
                    probs[j] = (dot_nope + dot_rope) * a.scale;
                }
                softmax(&mut probs);
                for (j, &pr) in probs.iter().enumerate().filter(|(_, pr)| !pr.is_zero()) {
                    let v = &kv_rows[j][head * (nope + vd) + nope..][..vd];
                    out.iter_mut().zip(v).for_each(|(o, &vv)| *o += pr * vv);
                }
            }
        });
    ctx
}
