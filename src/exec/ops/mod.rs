//! The element-wise and per-row operations of the GLM-5 forward, as transformers computes them
//! (its `GlmMoeDsa*` modules are the reference), in the run's number type.
//!
//! The modules below hold the larger ops apart from the forward: the rotary embedding, the
//! attention and indexer kernels' math that every backend shares, top-k near-tie handling,
//! and the names of the ops by which a run's time is counted (`op_clock`).

pub mod attention_core;
pub mod indexer_core;
pub mod op_clock;
pub mod rope;
pub mod ties;

use num_traits::Float;
use rayon::prelude::*;

use crate::exec::mat::Mat;
use crate::exec::real::Real;

/// RMSNorm: `w ⊙ x / sqrt(mean(x²) + eps)` per row.
pub fn rms_norm<E: Real>(x: &Mat<E>, w: &[E], eps: f64) -> Mat<E> {
    let mut out = x.clone();
    for r in 0..x.rows {
        let row = out.row_mut(r);
        let mean_sq = row.iter().map(|&v| v * v).sum::<E>() / E::lit(row.len() as f64);
        let inv = E::one() / (mean_sq + E::lit(eps)).sqrt();
        row.iter_mut()
            .zip(w)
            .for_each(|(v, &g)| *v = g * (*v * inv));
    }
    out
}

/// LayerNorm with weight and bias (the DSA indexer's `k_norm`), biased variance as torch.
pub fn layer_norm<E: Real>(x: &Mat<E>, w: &[E], b: &[E], eps: f64) -> Mat<E> {
    let mut out = x.clone();
    for r in 0..x.rows {
        let row = out.row_mut(r);
        let n = E::lit(row.len() as f64);
        let mean = row.iter().copied().sum::<E>() / n;
        let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<E>() / n;
        let inv = E::one() / (var + E::lit(eps)).sqrt();
        for ((v, &g), &bias) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * inv * g + bias;
        }
    }
    out
}

pub fn silu<E: Real>(x: E) -> E {
    x / (E::one() + (-x).exp())
}

pub fn sigmoid<E: Real>(x: E) -> E {
    E::one() / (E::one() + (-x).exp())
}

/// `silu(gate) ⊙ up`, in parallel (an `exp` a value).
pub fn silu_mul<E: Real>(gate: &Mat<E>, up: &Mat<E>) -> Mat<E> {
    let data = gate
        .data()
        .par_iter()
        .zip(up.data().par_iter())
        .map(|(&g, &u)| silu(g) * u)
        .collect();
    Mat::new(gate.rows, gate.cols, data)
}

/// Softmax of a row in place; entries at −∞ get 0, without an `exp` each where the row has a
/// finite maximum (`exp(−∞)` is 0 exactly): a causal row of attention is half masked.
pub fn softmax<E: Real>(row: &mut [E]) {
    let max = row.iter().copied().fold(E::neg_infinity(), Float::max);
    let mut sum = E::zero();
    let finite_max = max.is_finite();
    for v in row.iter_mut() {
        *v = if finite_max && *v == E::neg_infinity() {
            E::zero()
        } else {
            (*v - max).exp()
        };
        sum += *v;
    }
    row.iter_mut().for_each(|v| *v /= sum);
}

/// Indices of the `k` largest values, largest first (ties to the lower index), as torch.topk.
pub fn topk<E: Real>(values: &[E], k: usize) -> Vec<usize> {
    // A total order (the index breaks ties), so selecting the k first and sorting only them
    // gives exactly what sorting every index would.
    let order = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..values.len()).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_unstable_by(order);
    idx
}

/// The index of the greatest value, the lowest index among equals: `topk(values, 1)[0]` in one
/// pass without an index vector (a row of GLM-5's logits is 154880 values, and a prompt has
/// hundreds of rows). `None` for no values.
pub fn argmax<E: Real>(values: &[E]) -> Option<usize> {
    let mut best: Option<(usize, E)> = None;
    for (i, &v) in values.iter().enumerate() {
        match best {
            Some((_, b)) if v.total_cmp(&b) != std::cmp::Ordering::Greater => {}
            _ => best = Some((i, v)),
        }
    }
    best.map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_is_the_first_of_topk() {
        let cases: [&[f32]; 6] = [
            &[0.1, 3.0, -1.0, 3.0],
            &[-0.0, 0.0, -0.0],
            &[f32::NEG_INFINITY, f32::NEG_INFINITY],
            &[1.0, f32::NAN, 2.0],
            &[-f32::NAN, -5.0],
            &[7.0],
        ];
        for values in cases {
            assert_eq!(argmax(values), Some(topk(values, 1)[0]), "{values:?}");
        }
        let mut x = 1u32;
        let noisy: Vec<f32> = (0..10_000)
            .map(|_| {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (x >> 20) as f32 / 64.0
            })
            .collect();
        assert_eq!(argmax(&noisy), Some(topk(&noisy, 1)[0]));
        assert_eq!(argmax::<f32>(&[]), None);
    }

    #[test]
    fn topk_is_largest_first_and_softmax_ignores_minus_infinity() {
        assert_eq!(topk(&[0.1f32, 3.0, -1.0, 3.0], 3), vec![1, 3, 0]);
        assert_eq!(topk(&[0.1f32, 3.0, -1.0, 3.0], 9), vec![1, 3, 0, 2]);
        assert_eq!(topk(&[2.0f32, -0.0, 0.0, 2.0, 0.0], 4), vec![0, 3, 2, 4]);
        assert!(topk(&[1.0f32], 0).is_empty());
        let mut r = [0.0f64, f64::NEG_INFINITY, 0.0];
        softmax(&mut r);
        assert_eq!(r, [0.5, 0.0, 0.5]);
        // Masked entries skip `exp`, and every value keeps the bits of taking it.
        let row = [0.3f32, f32::NEG_INFINITY, -1.7, f32::NEG_INFINITY, 2.2];
        let mut got = row;
        softmax(&mut got);
        let e: Vec<f32> = row.iter().map(|v| (v - 2.2f32).exp()).collect();
        let sum = e.iter().fold(0f32, |s, v| s + v);
        let want: Vec<u32> = e.iter().map(|v| (v / sum).to_bits()).collect();
        assert_eq!(got.map(f32::to_bits).to_vec(), want);
        // A row with nothing to attend to stays NaN, as `exp` of −∞ − −∞ makes it.
        let mut none = [f32::NEG_INFINITY; 3];
        softmax(&mut none);
        assert!(none.iter().all(|v| v.is_nan()));
    }
}
