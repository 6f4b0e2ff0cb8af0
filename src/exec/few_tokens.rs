//! `x · wᵀ` for a few tokens (a decoding step, a routed expert's handful), bound by reading the
//! weight. gemm broadcasts six weight rows' values at a time against a column of tokens: six
//! strided streams through memory and a load per weight. Here each weight row is read once,
//! contiguously, 16 values at a time, against every token's features: 1.1–2.6× gemm's rate at 1
//! to 4 tokens on one core of the Intel test machine (weights from memory), and no better from
//! 8 tokens, where gemm takes over.
//!
//! The order of the sums is this module's own and the same on every machine: a dot product
//! runs in [`K_LANES`] lanes, feature `i` into lane `i mod K_LANES` by a fused multiply-add, each
//! lane in order, then the lanes added in order from lane 0. AVX2 with FMA and the portable loop
//! do exactly those operations (the lanes bound the rounding error too: about a tenth of gemm's
//! single-accumulator sums at 1024 features).

/// The most tokens a call takes this path.
pub const MAX_TOKENS: usize = 4;

/// Lanes of a dot product: feature `i` adds to lane `i mod K_LANES`.
pub const K_LANES: usize = 16;

/// `x · w[..rows]ᵀ` for `t` ≤ [`MAX_TOKENS`] tokens of `k` features, `x` row-major `[t, k]`
/// and `w` row-major with at least `rows` rows of `k`, laid out column-major: `[rows, t]`, a
/// weight row's outputs for every token.
pub fn x_times_weight_rows(x: &[f32], t: usize, w: &[f32], rows: usize, k: usize) -> Vec<f32> {
    assert!(
        t <= MAX_TOKENS && x.len() == t * k && w.len() >= rows * k,
        "few-token GEMM operands of the wrong size"
    );
    let mut dst = vec![0.0; rows * t];
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA; the assert bounds every read and `dst` every write.
        unsafe { avx2::rows(x, t, w, rows, k, &mut dst) };
        return dst;
    }
    portable_rows(x, t, w, rows, k, &mut dst);
    dst
}

/// The lanes one value at a time, where the CPU has no AVX2 (`mul_add` is the fused
/// multiply-add, in hardware or not).
fn portable_rows(x: &[f32], t: usize, w: &[f32], rows: usize, k: usize, dst: &mut [f32]) {
    for r in 0..rows {
        for tok in 0..t {
            let mut lanes = [0f32; K_LANES];
            for i in 0..k {
                lanes[i % K_LANES] = x[tok * k + i].mul_add(w[r * k + i], lanes[i % K_LANES]);
            }
            dst[r * t + tok] = in_lane_order(&lanes);
        }
    }
}

/// Lanes added one after another, from lane 0.
fn in_lane_order(lanes: &[f32; K_LANES]) -> f32 {
    lanes.iter().fold(0.0, |a, &b| a + b)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{in_lane_order, K_LANES, MAX_TOKENS};

    /// The portable loop's operations, two registers of eight lanes per token, the tokens of a
    /// row side by side so that the row is read once.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `x` holds `t * k` values, `w` at least `rows * k`, `dst`
    /// `rows * t`, `t` ≤ [`MAX_TOKENS`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn rows(x: &[f32], t: usize, w: &[f32], rows: usize, k: usize, dst: &mut [f32]) {
        let whole = k - k % K_LANES;
        for r in 0..rows {
            let row = w[r * k..].as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 2]; MAX_TOKENS];
            let mut i = 0;
            while i < whole {
                // SAFETY: i + 16 ≤ k, within the row and each token's features.
                unsafe {
                    let (w0, w1) = (_mm256_loadu_ps(row.add(i)), _mm256_loadu_ps(row.add(i + 8)));
                    for (tok, acc) in acc.iter_mut().enumerate().take(t) {
                        let f = x.as_ptr().add(tok * k + i);
                        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(f), w0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(_mm256_loadu_ps(f.add(8)), w1, acc[1]);
                    }
                }
                i += K_LANES;
            }
            for (tok, acc) in acc.iter().enumerate().take(t) {
                let mut lanes = [0f32; K_LANES];
                // SAFETY: 16 lanes stored into 16 floats.
                unsafe {
                    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
                }
                let features = &x[tok * k + whole..(tok + 1) * k];
                for (l, (&a, &b)) in features.iter().zip(&w[r * k + whole..]).enumerate() {
                    lanes[l] = a.mul_add(b, lanes[l]);
                }
                dst[r * t + tok] = in_lane_order(&lanes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// Whatever the CPU runs gives the portable loop's bits, at every token count and with
    /// features that do not fill the last lanes; and both are within f32's rounding of f64.
    #[test]
    fn every_path_sums_in_the_same_lanes() {
        for (t, rows, k) in [
            (1, 3, 1),
            (2, 5, 15),
            (3, 7, 16),
            (4, 9, 37),
            (4, 2, 1024),
            (1, 1, 0),
        ] {
            let (x, w) = (values(t * k, 1), values(rows * k + 5, 2));
            let got = x_times_weight_rows(&x, t, &w, rows, k);
            let mut want = vec![0.0; rows * t];
            portable_rows(&x, t, &w, rows, k, &mut want);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "t {t}, rows {rows}, k {k}"
            );
            for r in 0..rows {
                for tok in 0..t {
                    let exact: f64 = (0..k)
                        .map(|i| f64::from(x[tok * k + i]) * f64::from(w[r * k + i]))
                        .sum();
                    let got = f64::from(got[r * t + tok]);
                    assert!((got - exact).abs() <= 1e-6 * (1.0 + exact.abs()) * k as f64);
                }
            }
        }
    }
}
