//! MXFP4 as gguf-py quantizes it: a power-of-two scale from the block's absmax, then each value's
//! nearest E2M1 level.

use super::block::{absmax, each_block, np_byte, pack_nibbles};
use crate::weights::quant::grids::E2M1_VALUES;

/// MXFP4: E8M0 exponent `floor(log2(absmax)) - 2 + 127`, then per value the first E2M1 level
/// (doubled, times half the scale) at least distance.
pub(super) fn mxfp4(src: &[f32], dst: &mut [u8]) {
    let levels = E2M1_VALUES.map(f32::from);
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 17]| {
        let amax = absmax(x);
        let e = if amax > 0.0 {
            // numpy's float32 log2 is correctly rounded; rounding the f64 log2 reproduces it.
            np_byte(((amax as f64).log2() as f32).floor() - 2.0 + 127.0)
        } else {
            0
        };
        let d = e8m0_half(e);
        let q = x.map(|v| nearest_level(&levels, d, v));
        b[0] = e;
        pack_nibbles(&q, &mut b[1..]);
    });
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

/// The index of the first level whose `|d · level - v|` is least (numpy's `argmin`).
#[inline(always)]
fn nearest_level(levels: &[f32; 16], d: f32, v: f32) -> u8 {
    let err = |k: usize| (d * levels[k] - v).abs();
    (1..16).fold(0, |best, k| if err(k) < err(best) { k } else { best }) as u8
}
