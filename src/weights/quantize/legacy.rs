//! The legacy 32-element types, step for step as ggml's `quantize_row_q*_ref` (what
//! `quantize_q*` runs without an importance matrix): f32 arithmetic, truncation after adding an
//! offset of one half, and C's float to byte casts.

use super::block::{
    c_i8, c_max, c_u8, each_block, inverse, pack_nibbles, put_f16, round_i8, signed_absmax_first,
};

/// ggml's `MIN(max, (int8_t)(v * id + offset))` stored as a byte, for the 32 values.
#[inline(always)]
fn codes(x: &[f32; 32], sub: f32, id: f32, offset: f32, max: i32) -> [u8; 32] {
    x.map(|v| i32::from(c_i8((v - sub) * id + offset)).min(max) as u8)
}

/// The fifth bits of 32 five-bit codes, code j at bit j.
#[inline(always)]
fn fifth_bits(q: &[u8; 32]) -> [u8; 4] {
    let bits = q
        .iter()
        .enumerate()
        .fold(0u32, |acc, (j, &c)| acc | (u32::from((c & 0x10) >> 4) << j));
    bits.to_le_bytes()
}

/// The block's minimum and maximum as ggml scans them from `FLT_MAX` and `-FLT_MAX` with strict
/// comparisons: of equal values (0 and -0) the first one wins.
#[inline(always)]
fn min_max(x: &[f32; 32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// Q4_0 (`quantize_row_q4_0_ref`): `d` = the first signed extreme / -8, codes
/// `MIN(15, (int8_t)(x / d + 8.5))`.
pub(super) fn q4_0(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 18]| {
        let d = signed_absmax_first(x) / -8.0;
        let q = codes(x, 0.0, inverse(d), 8.5, 15);
        put_f16(b, 0, d);
        pack_nibbles(&q, &mut b[2..]);
    });
}

/// Q4_1 (`quantize_row_q4_1_ref`): `d` = (max - min) / 15 and `m` = min, codes
/// `MIN(15, (int8_t)((x - min) / d + 0.5))`.
pub(super) fn q4_1(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 20]| {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let q = codes(x, min, inverse(d), 0.5, 15);
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        pack_nibbles(&q, &mut b[4..]);
    });
}

/// Q5_0 (`quantize_row_q5_0_ref`): `d` = the first signed extreme / -16, codes
/// `MIN(31, (int8_t)(x / d + 16.5))`.
pub(super) fn q5_0(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 22]| {
        let d = signed_absmax_first(x) / -16.0;
        let q = codes(x, 0.0, inverse(d), 16.5, 31);
        put_f16(b, 0, d);
        b[2..6].copy_from_slice(&fifth_bits(&q));
        pack_nibbles(&q.map(|c| c & 0x0f), &mut b[6..]);
    });
}

/// Q5_1 (`quantize_row_q5_1_ref`): `d` = (max - min) / 31 and `m` = min, codes
/// `(uint8_t)((x - min) / d + 0.5)`, not clamped.
pub(super) fn q5_1(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 24]| {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse(d);
        let q = x.map(|v| c_u8((v - min) * id + 0.5));
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        b[4..8].copy_from_slice(&fifth_bits(&q));
        pack_nibbles(&q.map(|c| c & 0x0f), &mut b[8..]);
    });
}

/// Q8_0 (`quantize_row_q8_0_ref`): `d` = absmax / 127, codes `roundf(x / d)` (half away from
/// zero).
pub(super) fn q8_0(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 34]| {
        let amax = x.iter().fold(0.0f32, |m, v| c_max(m, v.abs()));
        let d = amax / 127.0;
        let id = inverse(d);
        put_f16(b, 0, d);
        for (o, &v) in b[2..].iter_mut().zip(x) {
            *o = round_i8(v * id) as u8;
        }
    });
}
