//! Rotary position embedding of the rope dims: the frequencies (plain, or YaRN-scaled as
//! transformers computes them), the cos/sin scale, and the rotation in either pair layout.

use rayon::prelude::*;

use crate::exec::mat::Mat;
use crate::exec::real::Real;
use crate::model::config::{yarn_mscale, Glm5Config, Yarn};

/// The frequencies and cos/sin scale a model's RoPE uses, shared by MLA and the indexer.
pub struct Rope<E> {
    inv_freq: Vec<E>,
    /// YaRN's attention factor (1 without YaRN), applied to cos and sin.
    scale: E,
}

impl<E: Real> Rope<E> {
    pub fn new(cfg: &Glm5Config) -> Self {
        let dim = cfg.qk_rope_head_dim as usize;
        let plain = inv_freq(cfg.rope_theta, dim);
        match &cfg.yarn {
            None => Rope {
                inv_freq: plain.iter().map(|&f| E::lit(f)).collect(),
                scale: E::one(),
            },
            Some(y) => Rope {
                inv_freq: yarn_inv_freq(y, &plain, cfg.rope_theta, dim)
                    .into_iter()
                    .map(E::lit)
                    .collect(),
                scale: E::lit(yarn_attention_factor(y)),
            },
        }
    }

    /// The scaled sine and cosine of each of the first `pairs` pairs' angles at `pos`.
    fn sin_cos(&self, pos: usize, pairs: usize) -> Vec<(E, E)> {
        self.inv_freq
            .iter()
            .take(pairs)
            .map(|&f| {
                let (s, c) = (E::lit(pos as f64) * f).sin_cos();
                (s * self.scale, c * self.scale)
            })
            .collect()
    }
}

/// `x` (the rope slice of one head) rotated in place by its pairs' scaled `(sin, cos)`:
/// interleaved pairs `(x₂ᵢ, x₂ᵢ₊₁)` (GLM-5, llama.cpp NORM, vLLM `is_neox_style=False`), or NeoX
/// halves `(xᵢ, xᵢ₊d/2)`. Output stays in the input's pair layout.
fn turn<E: Real>(x: &mut [E], sin_cos: &[(E, E)], interleaved: bool) {
    let half = x.len() / 2;
    for (i, &(s, c)) in sin_cos.iter().enumerate().take(half) {
        let (a, b) = if interleaved {
            (2 * i, 2 * i + 1)
        } else {
            (i, i + half)
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x1 * c + x0 * s;
    }
}

/// Which values of each row RoPE rotates: the row's heads of `width` values, in each the rope
/// dims from `offset`; row `i` at position `start + i`, in interleaved pairs or NeoX halves.
#[derive(Clone, Copy, Debug)]
pub struct RotateSpec {
    pub width: usize,
    pub offset: usize,
    pub start: usize,
    pub interleaved: bool,
}

impl<E: Real> Rope<E> {
    /// Plain RoPE of `dims` dims with base `theta` (frequencies rounded through f32 as for a
    /// model) and `scale` on cos and sin.
    pub fn plain(theta: f64, dims: usize, scale: f64) -> Self {
        Rope {
            inv_freq: inv_freq(theta, dims).into_iter().map(E::lit).collect(),
            scale: E::lit(scale),
        }
    }

    /// The frequencies, one per pair of rope dims.
    pub fn inv_freq(&self) -> &[E] {
        &self.inv_freq
    }

    /// The factor on cos and sin (YaRN's attention factor, else 1).
    pub fn scale(&self) -> E {
        self.scale
    }

    /// Every head of every row of `m` rotated as `spec` says (the CPU's loops): rows in
    /// parallel, each row's angles computed once for all its heads.
    pub fn rotate_rows(&self, m: &mut Mat<E>, spec: RotateSpec) {
        let pairs = self.inv_freq.len();
        let cols = m.cols.max(1);
        m.data_mut()
            .par_chunks_mut(cols)
            .enumerate()
            .for_each(|(i, row)| {
                let sin_cos = self.sin_cos(spec.start + i, pairs);
                for head in row.chunks_exact_mut(spec.width) {
                    let rot = &mut head[spec.offset..spec.offset + 2 * pairs];
                    turn(rot, &sin_cos, spec.interleaved);
                }
            });
    }
}

/// The per-pair angles of plain RoPE: `θ^(−2i/dim)`, i < dim/2, rounded through f32 as
/// transformers computes them.
fn inv_freq(theta: f64, dim: usize) -> Vec<f64> {
    (0..dim / 2)
        .map(|i| f64::from((1.0 / theta.powf(2.0 * i as f64 / dim as f64)) as f32))
        .collect()
}

/// The cos/sin scale: explicit, else the ratio of the two mscales, else from the factor alone.
pub fn yarn_attention_factor(y: &Yarn) -> f64 {
    match (y.attention_factor, y.mscale, y.mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(all)) => yarn_mscale(y.factor, m) / yarn_mscale(y.factor, all),
        _ => yarn_mscale(y.factor, 1.0),
    }
}

/// Frequencies blended between extrapolation (fast dims) and interpolation by `factor` (slow
/// dims) along a linear ramp over the correction range.
fn yarn_inv_freq(y: &Yarn, plain: &[f64], theta: f64, dim: usize) -> Vec<f64> {
    let correction_dim = |rotations: f64| {
        dim as f64
            * (y.original_max_position_embeddings as f64 / (rotations * 2.0 * std::f64::consts::PI))
                .ln()
            / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001;
    }
    plain
        .iter()
        .enumerate()
        .map(|(i, &extrapolated)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            let interpolated = extrapolated / y.factor;
            interpolated * (1.0 - keep) + extrapolated * keep
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_by_position_times_frequency() {
        let rope = Rope::<f32> {
            inv_freq: inv_freq(10000.0, 4).into_iter().map(|f| f as f32).collect(),
            scale: 1.0,
        };
        assert_eq!(rope.inv_freq[0], 1.0);
        // One row of two heads at position 2, each head's 4 values all rope dims.
        let mut m = Mat::new(1, 8, vec![1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
        let spec = RotateSpec {
            width: 4,
            offset: 0,
            start: 2,
            interleaved: true,
        };
        rope.rotate_rows(&mut m, spec);
        let (x, other) = m.data().split_at(4);
        assert_eq!(x, other, "every head at a position turns alike");
        assert!((x[0] - 2f32.cos()).abs() < 1e-6 && (x[1] - 2f32.sin()).abs() < 1e-6);
        let angle = 2.0 * rope.inv_freq[1];
        assert!((x[2] - angle.cos()).abs() < 1e-6 && (x[3] - angle.sin()).abs() < 1e-6);
    }
}
