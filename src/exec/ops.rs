//! The element-wise and per-row operations of the GLM-5 forward, as transformers computes them
//! in f32 (its `GlmMoeDsa*` modules are the reference).

use super::mat::Mat;

/// RMSNorm: `w ⊙ x / sqrt(mean(x²) + eps)` per row.
pub fn rms_norm(x: &Mat, w: &[f32], eps: f64) -> Mat {
    let mut out = x.clone();
    for r in 0..x.rows {
        let row = out.row_mut(r);
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let inv = 1.0 / (mean_sq + eps as f32).sqrt();
        row.iter_mut().zip(w).for_each(|(v, g)| *v = g * (*v * inv));
    }
    out
}

/// LayerNorm with weight and bias (the DSA indexer's `k_norm`), biased variance as torch.
pub fn layer_norm(x: &Mat, w: &[f32], b: &[f32], eps: f64) -> Mat {
    let mut out = x.clone();
    for r in 0..x.rows {
        let row = out.row_mut(r);
        let n = row.len() as f32;
        let mean = row.iter().sum::<f32>() / n;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
        let inv = 1.0 / (var + eps as f32).sqrt();
        for ((v, g), bias) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * inv * g + bias;
        }
    }
    out
}

/// The per-pair angles of RoPE: `inv_freq_i = θ^(−2i/dim)`, i < dim/2.
pub fn inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| (1.0 / theta.powf(2.0 * i as f64 / dim as f64)) as f32)
        .collect()
}

/// Rotate `x` (the rope slice of one head at position `pos`) in place: interleaved pairs
/// `(x₂ᵢ, x₂ᵢ₊₁)` (GLM-5, llama.cpp NORM, vLLM `is_neox_style=False`), or NeoX halves
/// `(xᵢ, xᵢ₊d/2)`. Output stays in the input's pair layout.
pub fn rope(x: &mut [f32], pos: usize, inv_freq: &[f32], interleaved: bool) {
    let half = x.len() / 2;
    for (i, f) in inv_freq.iter().enumerate().take(half) {
        let angle = pos as f32 * f;
        let (s, c) = angle.sin_cos();
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

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `silu(gate) ⊙ up`.
pub fn silu_mul(gate: &Mat, up: &Mat) -> Mat {
    let data = gate
        .data
        .iter()
        .zip(&up.data)
        .map(|(g, u)| silu(*g) * u)
        .collect();
    Mat::new(gate.rows, gate.cols, data)
}

/// Softmax of a row in place; entries at −∞ get 0.
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    row.iter_mut().for_each(|v| *v /= sum);
}

/// Indices of the `k` largest values, largest first (ties to the lower index), as torch.topk.
pub fn topk(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_by_position_times_frequency() {
        let f = inv_freq(10000.0, 4);
        assert_eq!(f[0], 1.0);
        let mut x = [1.0, 0.0, 1.0, 0.0];
        rope(&mut x, 2, &f, true);
        assert!((x[0] - 2f32.cos()).abs() < 1e-6 && (x[1] - 2f32.sin()).abs() < 1e-6);
        let angle = 2.0 * f[1];
        assert!((x[2] - angle.cos()).abs() < 1e-6 && (x[3] - angle.sin()).abs() < 1e-6);
    }

    #[test]
    fn topk_is_largest_first_and_softmax_ignores_minus_infinity() {
        assert_eq!(topk(&[0.1, 3.0, -1.0, 3.0], 3), vec![1, 3, 0]);
        let mut r = [0.0, f32::NEG_INFINITY, 0.0];
        softmax(&mut r);
        assert_eq!(r, [0.5, 0.0, 0.5]);
    }
}
