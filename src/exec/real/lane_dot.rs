//! f32 dot products summed in [`LANES`] lanes: term `i` into lane `i mod LANES` by a fused
//! multiply-add, each lane in order, then the lanes added in order from lane 0. AVX2 with FMA
//! and the portable loop do exactly those operations, so a dot product is the same on every
//! machine; a sum in sequence waits on one add per term (its latency, not the core's width) and
//! rounds about ten times further from f64 at a thousand terms.

/// Lanes of a dot product: term `i` adds to lane `i mod LANES`.
pub const LANES: usize = 16;

/// `Σ a[i]·b[i]` over the shorter of the two, in lanes.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA; `a` and `b` have the same length.
            return unsafe { avx2::dot(a, b) };
        }
    }
    finish([0.0; LANES], a, b)
}

/// A dot product from its lanes so far: the terms `a`·`b` not yet in them (fewer than one
/// lane's worth, or all of them) added lane by lane, then the lanes added in order from lane 0.
pub fn finish(mut lanes: [f32; LANES], a: &[f32], b: &[f32]) -> f32 {
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        lanes[i % LANES] = x.mul_add(y, lanes[i % LANES]);
    }
    lanes.iter().fold(0.0, |sum, &lane| sum + lane)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{finish, LANES};

    /// [`super::dot`]'s operations, the whole lanes' terms in two registers of eight.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `a` and `b` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let whole = a.len() - a.len() % LANES;
        let (mut low, mut high) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for i in (0..whole).step_by(LANES) {
            // SAFETY: i + 16 ≤ whole ≤ the length of both.
            unsafe {
                let (x, y) = (a.as_ptr().add(i), b.as_ptr().add(i));
                low = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(y), low);
                high = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(8)), _mm256_loadu_ps(y.add(8)), high);
            }
        }
        let mut lanes = [0f32; LANES];
        // SAFETY: 16 lanes stored into 16 floats.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), low);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), high);
        }
        finish(lanes, &a[whole..], &b[whole..])
    }
}

/// Operands for the tests of the dot products built on these lanes.
#[cfg(test)]
pub(crate) mod test_values {
    /// `n` values in [−1, 1] whose sums depend on their order in f32.
    pub fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    }

    /// Whether `got` is within f32's rounding of `a`·`b` summed in f64.
    pub fn near_exact(got: f32, a: &[f32], b: &[f32]) -> bool {
        let exact: f64 = a
            .iter()
            .zip(b)
            .map(|(&x, &y)| f64::from(x) * f64::from(y))
            .sum();
        (f64::from(got) - exact).abs() <= 1e-6 * (1.0 + exact.abs()) * a.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::test_values::{near_exact, values};
    use super::*;

    /// The dispatched dot product is the portable loop's, bit for bit, at lengths that fill no
    /// lane, some lanes, whole lanes and whole lanes and a tail; and within f32's rounding of
    /// f64.
    #[test]
    fn the_dispatched_dot_product_is_the_portable_loops() {
        for n in [0, 1, 7, 15, 16, 17, 64, 192, 257, 1000] {
            let (a, b) = (values(n, 1), values(n + 3, 2));
            let want = finish([0.0; LANES], &a, &b[..n]);
            assert_eq!(dot(&a, &b).to_bits(), want.to_bits(), "{n} terms");
            assert!(near_exact(want, &a, &b[..n]), "{n} terms");
        }
        // The lanes in order: term 16 joins lane 0, and the lanes are added from lane 0.
        let mut a = vec![0f32; 17];
        let b = vec![1f32; 17];
        a[0] = 1e8;
        a[16] = 1.0;
        a[1] = -1e8;
        // Lane 0 holds 1e8 + 1 = 1e8 (rounded), lane 1 −1e8: the sum is 0, where a sum in
        // sequence would give 1.
        assert_eq!(dot(&a, &b), 0.0);
    }
}
