//! A tiny deterministic generator, shared by the synthetic models, the self-test and the tests:
//! the same seed gives the same model on every machine, and every row of every weight has its
//! own stream, so rows can be made in any order or in parallel.

/// SplitMix64 (Steele, Lea, Flood 2014): fast, well mixed, one u64 of state.
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// The stream of row `row` of the weight named `key`, under the model seed `seed`.
    pub fn for_row(seed: u64, key: &str, row: u64) -> Self {
        // FNV-1a over the name, then mixed with the seed and the row by SplitMix itself.
        let name = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let mut s = SplitMix(seed ^ name);
        let mixed = s.next_u64() ^ row.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        SplitMix(SplitMix(mixed).next_u64())
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Approximately standard normal, from one draw: the sum of four 16-bit uniforms (Irwin–Hall),
    /// centred and scaled to unit variance. Bounded by ±3.46, bell-shaped, and cheap enough for
    /// billions of weights.
    pub fn normal(&mut self) -> f32 {
        let r = self.next_u64();
        let sum: u32 = (0..4).map(|k| ((r >> (16 * k)) & 0xffff) as u32).sum();
        // Each 16-bit part is uniform on [0, 65535]: mean 2·65535, variance 4·(65536² − 1)/12.
        const MEAN: f32 = 2.0 * 65535.0;
        const STD: f32 = 37837.227; // sqrt(4 · (65536² − 1) / 12)
        (sum as f32 - MEAN) / STD
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_moments_and_rows_differ() {
        let mut r = SplitMix::new(1);
        let xs: Vec<f64> = (0..200_000).map(|_| f64::from(r.normal())).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "mean {mean} var {var}"
        );
        let a = SplitMix::for_row(7, "w", 0).next_u64();
        assert_ne!(a, SplitMix::for_row(7, "w", 1).next_u64());
        assert_ne!(a, SplitMix::for_row(7, "v", 0).next_u64());
        assert_eq!(a, SplitMix::for_row(7, "w", 0).next_u64());
    }
}
