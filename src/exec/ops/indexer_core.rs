//! The DSA lightning indexer's scores, apart from the forward: what every backend computes for
//! the indexer's choice of keys (the CPU's loops are the default of `Backend::indexer_scores`),
//! so that backends depend on it and not on the forward's attention step.

use rayon::prelude::*;

use crate::exec::mat::Mat;
use crate::exec::passes::Passes;
use crate::exec::real::Real;

/// What the indexer scores for a batch of new positions: their rotated queries `q` `[t, heads ·
/// dim]`, every cached key `keys` `[positions, dim]` (normalised and rotated, one head shared by
/// the query heads; as the passes added them), and each query's head weights `weights` `[t,
/// heads]`.
pub struct IndexerInputs<'a, E> {
    pub q: &'a Mat<E>,
    pub keys: Passes<'a, E>,
    pub weights: &'a Mat<E>,
    pub heads: usize,
    pub dim: usize,
    /// Position of the first query.
    pub start: usize,
    /// `dim^-½`, on each head's dot product.
    pub scale: E,
    /// `heads^-½`, on each head's weight.
    pub head_scale: E,
}

impl<E: Real> IndexerInputs<'_, E> {
    /// Cached positions, the new ones included.
    pub fn positions(&self) -> usize {
        self.keys.positions()
    }
}

/// `[t, positions]` scores: for query `i` (position `start + i`) and key `j` up to it,
/// `Σ_h (w_h · head_scale) · relu(q_h · k_j · scale)`; −∞ past the query's own position. The
/// CPU's loops, queries in parallel, each score's sums in one fixed order: every dot product and
/// the sum over heads from −0 in sequence (as an iterator's `sum`), which the GPU's kernel
/// repeats so that the two agree bit for bit in f32.
pub fn indexer_scores_core<E: Real>(a: &IndexerInputs<'_, E>) -> Vec<E> {
    let (t, total, dim) = (a.q.rows, a.positions(), a.dim);
    let mut scores = vec![E::neg_infinity(); t * total];
    if total == 0 {
        return scores;
    }
    let keys = a.keys.rows();
    scores
        .par_chunks_mut(total)
        .enumerate()
        .for_each(|(i, row)| {
            let (q, w) = (a.q.row(i), a.weights.row(i));
            for (j, score) in row.iter_mut().enumerate().take(a.start + i + 1) {
                let key = &keys[j][..dim];
                *score = (0..a.heads)
                    .map(|head| {
                        let dot: E = q[head * dim..(head + 1) * dim]
                            .iter()
                            .zip(key)
                            .map(|(&x, &k)| x * k)
                            .sum();
                        w[head] * a.head_scale * relu(dot * a.scale)
                    })
                    .sum();
            }
        });
    scores
}

/// `x` where positive, else +0 (NaN included): one definition for every backend, where `max`
/// leaves the sign of a zero to the platform.
pub fn relu<E: Real>(x: E) -> E {
    if x > E::zero() {
        x
    } else {
        E::zero()
    }
}
