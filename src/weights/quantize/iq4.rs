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

/// The trials of a group's scale: the absmax-based inverse scale, then `2 · NTRY + 1` more.
const TRIALS: usize = 2 * NTRY as usize + 2;

/// The 16 levels as f32, ascending, the 15 midpoints between neighbours and the 15 steps
/// between neighbours.
///
/// ggml's `best_index_int8` bisects to the two levels around `x` and takes the upper one unless
/// `x - lower < upper - x`. Near a midpoint both differences are exact in f32 (each lies in the
/// binade of `x` or below it, and the levels are integers), so that test is `x < midpoint`
/// exactly, and away from midpoints rounding cannot flip it: the chosen index is the number of
/// midpoints `m` with `!(x < m)`, NaN included (ggml's bisection ends at 15 for NaN too). Counting
/// needs no branches, so many values go through it at once.
struct Levels {
    values: [f32; 16],
    mids: [f32; 15],
    steps: [f32; 15],
}

impl Levels {
    fn new() -> Self {
        let values = IQ4NL_VALUES.map(f32::from);
        Levels {
            values,
            mids: std::array::from_fn(|k| (values[k] + values[k + 1]) / 2.0),
            steps: std::array::from_fn(|k| values[k + 1] - values[k]),
        }
    }

    /// The index `best_index_int8` gives `x`.
    #[inline(always)]
    fn nearest(&self, x: f32) -> u8 {
        self.mids.iter().map(|&m| if x < m { 0 } else { 1 }).sum()
    }

    /// The level `best_index_int8` picks for `x`: the lowest level plus the steps up to it, all
    /// integers, so the sum is exact.
    #[inline(always)]
    fn nearest_value(&self, x: f32) -> f32 {
        let mut q = self.values[0];
        for (&m, &step) in self.mids.iter().zip(&self.steps) {
            q += if x < m { 0.0 } else { step };
        }
        q
    }

    /// The group scale of `quantize_row_iq4_nl_impl`: the least-squares scale for the levels at
    /// `d = max / 127`, then for the inverse scales `(itry - 127) / max`, itry in -7..=7, the
    /// one of greatest `(Σ w·q·x)² / Σ w·q²`. 0 for an all-zero group. The trials' sums do not
    /// depend on one another, so they run side by side, each in ggml's order; the choice among
    /// them then goes in ggml's order of trials.
    #[inline(always)]
    fn group_scale(&self, xb: &[f32; 32]) -> f32 {
        let (amax, max) = abs_and_signed_max(xb);
        if amax < GROUP_MAX_EPS {
            return 0.0;
        }
        let first = i32::from(IQ4NL_VALUES[0]);
        let mut ids = [0f32; TRIALS];
        ids[0] = 1.0 / (-max / first as f32);
        for (t, id) in ids.iter_mut().enumerate().skip(1) {
            let itry = t as i32 - 1 - NTRY;
            *id = (itry + first) as f32 / max;
        }
        let (mut sumqx, mut sumq2) = ([0f32; TRIALS], [0f32; TRIALS]);
        for &x in xb {
            let w = x * x;
            for t in 0..TRIALS {
                let q = self.nearest_value(ids[t] * x);
                sumqx[t] += w * q * x;
                sumq2[t] += w * q * q;
            }
        }
        let mut d = if sumq2[0] > 0.0 {
            sumqx[0] / sumq2[0]
        } else {
            0.0
        };
        let mut best = d * sumqx[0];
        for t in 1..TRIALS {
            if sumq2[t] > 0.0 && sumqx[t] * sumqx[t] > best * sumq2[t] {
                d = sumqx[t] / sumq2[t];
                best = d * sumqx[t];
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

    /// ggml's `best_index_int8`, bisection and all.
    fn bisect(v: &[f32; 16], x: f32) -> u8 {
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

    #[test]
    fn counting_midpoints_is_ggml_bisection() {
        let levels = Levels::new();
        let check = |x: f32| {
            let want = bisect(&levels.values, x);
            assert_eq!(levels.nearest(x), want, "{x:e}");
            assert_eq!(
                levels.nearest_value(x).to_bits(),
                levels.values[usize::from(want)].to_bits(),
                "{x:e}"
            );
        };
        // Every float within 4096 ulps of each midpoint and each level, both signs of zero.
        for &c in levels.mids.iter().chain(&levels.values) {
            for k in -4096i32..=4096 {
                check(f32::from_bits(c.to_bits().wrapping_add_signed(k)));
            }
        }
        for x in [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-40,
            -1e-40,
        ] {
            check(x);
        }
        // And a sweep over the codebook's whole range and beyond.
        for i in -3_000_000..3_000_000 {
            check(i as f32 * 5e-5);
        }
        assert_eq!(levels.nearest(-4.5), 8);
        assert_eq!(levels.nearest(-4.6), 7);
    }
}
