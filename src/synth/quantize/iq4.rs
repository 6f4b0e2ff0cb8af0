//! IQ4_NL and IQ4_XS as ggml's `quantize_iq4_nl` and `quantize_iq4_xs` quantize them without an
//! importance matrix: `quantize_row_iq4_nl_impl` with `ntry` 7 and x² weights. Each group of 32
//! gets the scale of best weighted fit over 16 trial inverse scales, and its values the nearest
//! of the 16 non-linear levels at the stored scale.

use super::block::{abs_and_signed_max, each_block, group, inverse, nearest_int, put_f16};
use crate::weights::quant::grids::IQ4NL_VALUES;

/// ggml's `GROUP_MAX_EPS`: groups whose absmax is below it get scale 0.
const GROUP_MAX_EPS: f32 = 1e-15;

/// The trials either side of the absmax-based inverse scale (`ntry`).
const NTRY: i32 = 7;

/// The 16 levels as f32, ascending.
struct Levels([f32; 16]);

impl Levels {
    fn new() -> Self {
        Levels(IQ4NL_VALUES.map(f32::from))
    }

    /// ggml's `best_index_int8`: the nearest level by bisection, the upper one on ties.
    #[inline(always)]
    fn nearest(&self, x: f32) -> u8 {
        let v = &self.0;
        if x <= v[0] {
            return 0;
        }
        if x >= v[15] {
            return 15;
        }
        let (mut ml, mut mu) = (0usize, 15usize);
        while mu - ml > 1 {
            let mav = (ml + mu) / 2;
            if x < v[mav] {
                mu = mav;
            } else {
                ml = mav;
            }
        }
        if x - v[mu - 1] < v[mu] - x {
            (mu - 1) as u8
        } else {
            mu as u8
        }
    }

    /// The weighted sums `(Σ w·q·x, Σ w·q²)` of the levels nearest `x · id`.
    #[inline(always)]
    fn fit(&self, xb: &[f32; 32], weight: &[f32; 32], id: f32) -> (f32, f32) {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for (&x, &w) in xb.iter().zip(weight) {
            let q = self.0[usize::from(self.nearest(id * x))];
            sumqx += w * q * x;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    }

    /// The group scale of `quantize_row_iq4_nl_impl`: the least-squares scale for the levels at
    /// `d = max / 127`, then for the inverse scales `(itry - 127) / max`, itry in -7..=7, the
    /// one of greatest `(Σ w·q·x)² / Σ w·q²`. 0 for an all-zero group.
    #[inline(always)]
    fn group_scale(&self, xb: &[f32; 32]) -> f32 {
        let weight = xb.map(|v| v * v);
        let (amax, max) = abs_and_signed_max(xb);
        if amax < GROUP_MAX_EPS {
            return 0.0;
        }
        let first = i32::from(IQ4NL_VALUES[0]);
        let d = -max / first as f32;
        let (sumqx, sumq2) = self.fit(xb, &weight, 1.0 / d);
        let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -NTRY..=NTRY {
            let id = (itry + first) as f32 / max;
            let (sumqx, sumq2) = self.fit(xb, &weight, id);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        d
    }

    /// The 32 nearest-level indices of `x · id`, packed as ggml's 4-bit layout.
    #[inline(always)]
    fn pack(&self, xb: &[f32; 32], id: f32, out: &mut [u8]) {
        let l = xb.map(|v| self.nearest(id * v));
        for (j, o) in out[..16].iter_mut().enumerate() {
            *o = l[j] | (l[j + 16] << 4);
        }
    }
}

/// IQ4_NL: the group scale as f16 `d` (from the unrounded scale), then the indices at the
/// inverse of the unrounded scale, as ggml computes them.
pub(super) fn iq4_nl(src: &[f32], dst: &mut [u8]) {
    let levels = Levels::new();
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 18]| {
        let scale = levels.group_scale(x);
        put_f16(b, 0, scale);
        levels.pack(x, inverse(scale), &mut b[2..]);
    });
}

/// IQ4_XS: eight group scales, a super-block `d` = -(scale of largest magnitude) / 32 as f16,
/// 6-bit group scales `nearest_int(scale / d)` clamped to -32..31 (stored + 32: low nibbles in
/// `scales_l`, top two bits in `scales_h`), and each group's indices at its stored scale.
pub(super) fn iq4_xs(src: &[f32], dst: &mut [u8]) {
    let levels = Levels::new();
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 136]| {
        let mut scales = [0f32; 8];
        let (mut amax_scale, mut max_scale) = (0f32, 0f32);
        for (ib, s) in scales.iter_mut().enumerate() {
            *s = levels.group_scale(group(x, ib));
            if s.abs() > amax_scale {
                amax_scale = s.abs();
                max_scale = *s;
            }
        }
        let d = -max_scale / 32.0;
        put_f16(b, 0, d);
        let id = inverse(d);
        let mut scales_h = 0u16;
        for (ib, &s) in scales.iter().enumerate() {
            let l = nearest_int(id * s).clamp(-32, 31);
            let dl = d * l as f32;
            levels.pack(group(x, ib), inverse(dl), &mut b[8 + 16 * ib..]);
            let l = (l + 32) as u8;
            if ib % 2 == 0 {
                b[4 + ib / 2] = l & 0x0f;
            } else {
                b[4 + ib / 2] |= (l & 0x0f) << 4;
            }
            scales_h |= u16::from(l >> 4) << (2 * ib);
        }
        b[2..4].copy_from_slice(&scales_h.to_le_bytes());
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_level_takes_the_upper_one_on_ties() {
        let levels = Levels::new();
        assert_eq!(levels.nearest(-200.0), 0);
        assert_eq!(levels.nearest(200.0), 15);
        assert_eq!(levels.nearest(0.0), 8);
        // Halfway between -10 and 1.
        assert_eq!(levels.nearest(-4.5), 8);
        assert_eq!(levels.nearest(-4.6), 7);
    }
}
