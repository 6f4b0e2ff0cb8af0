//! MXFP4 as ggml's `quantize_row_mxfp4_ref` quantizes it: a power-of-two scale from the block's
//! absmax, then each value's nearest E2M1 level.

use super::block::{c_u8, each_block, pack_nibbles};
use crate::weights::quant::grids::E2M1_VALUES;

/// MXFP4: E8M0 exponent `(uint8_t)(floorf(log2f(absmax)) - 2 + 127)`, then per value the first
/// E2M1 level (doubled, times half the scale) at least distance.
pub(super) fn mxfp4(src: &[f32], dst: &mut [u8]) {
    let levels = E2M1_VALUES.map(f32::from);
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 17]| {
        let mut amax = 0.0f32;
        for &v in x {
            if amax < v.abs() {
                amax = v.abs();
            }
        }
        let e = if amax > 0.0 {
            c_u8(floor_log2(amax) - 2.0 + 127.0)
        } else {
            0
        };
        let d = e8m0_half(e);
        let q = x.map(|v| nearest_level(&levels, d, v));
        b[0] = e;
        pack_nibbles(&q, &mut b[1..]);
    });
}

/// `floorf(log2f(v))` for positive `v`. glibc's `log2f` is correctly rounded wherever the floor
/// of its result can turn (just below powers of two), and so is the f64 `log2` rounded to f32;
/// the two floors agree on every positive finite f32.
#[inline(always)]
fn floor_log2(v: f32) -> f32 {
    ((v as f64).log2() as f32).floor()
}

/// Half the E8M0 scale `2^(e - 127)`, subnormal for `e` below 2 (ggml's `e8m0_to_fp32_half`).
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// ggml's `best_index_mxfp4`: the index of the first level whose `|level · d - v|` is least.
#[inline(always)]
fn nearest_level(levels: &[f32; 16], d: f32, v: f32) -> u8 {
    let mut best = 0;
    let mut best_err = (levels[0] * d - v).abs();
    for (k, &l) in levels.iter().enumerate().skip(1) {
        let err = (l * d - v).abs();
        if err < best_err {
            best = k;
            best_err = err;
        }
    }
    best as u8
}
