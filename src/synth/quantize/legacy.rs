//! The legacy 32-element types, step for step as gguf-py's `quantize_blocks`: f32 arithmetic,
//! truncation after adding an offset of one half, and numpy's casts.

use super::block::{
    absmax, each_block, inverse, min_max, np_byte, np_round_byte, pack_nibbles, put_f16,
    signed_absmax,
};

/// Codes `trunc(x * id + offset)` clipped to `max`, as gguf-py's
/// `np.trunc(...).astype(np.uint8).clip(0, max)` (the cast truncates, so no `trunc` is needed).
#[inline(always)]
fn codes(x: &[f32; 32], sub: f32, id: f32, offset: f32, max: u8) -> [u8; 32] {
    x.map(|v| np_byte((v - sub) * id + offset).min(max))
}

/// The fifth bits of 32 five-bit codes, code j at bit j.
#[inline(always)]
fn fifth_bits(q: &[u8; 32]) -> [u8; 4] {
    let bits = q
        .iter()
        .enumerate()
        .fold(0u32, |acc, (j, &c)| acc | (u32::from(c >> 4 != 0) << j));
    bits.to_le_bytes()
}

/// Q4_0: `d` = the signed extreme / -8, codes `trunc(x / d + 8.5)`.
pub(super) fn q4_0(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 18]| {
        let d = signed_absmax(x) / -8.0;
        let q = codes(x, 0.0, inverse(d), 8.5, 15);
        put_f16(b, 0, d);
        pack_nibbles(&q, &mut b[2..]);
    });
}

/// Q4_1: `d` = (max - min) / 15 and `m` = min, codes `trunc((x - min) / d + 0.5)`.
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

/// Q5_0: `d` = the signed extreme / -16, codes `trunc(x / d + 16.5)`.
pub(super) fn q5_0(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 22]| {
        let d = signed_absmax(x) / -16.0;
        let q = codes(x, 0.0, inverse(d), 16.5, 31);
        put_f16(b, 0, d);
        b[2..6].copy_from_slice(&fifth_bits(&q));
        pack_nibbles(&q, &mut b[6..]);
    });
}

/// Q5_1: `d` = (max - min) / 31 and `m` = min, codes `trunc((x - min) / d + 0.5)`.
pub(super) fn q5_1(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 24]| {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let q = codes(x, min, inverse(d), 0.5, 31);
        put_f16(b, 0, d);
        put_f16(b, 2, min);
        b[4..8].copy_from_slice(&fifth_bits(&q));
        pack_nibbles(&q, &mut b[8..]);
    });
}

/// Q8_0: `d` = absmax / 127, codes rounded half away from zero (gguf-py's `np_roundf`, ggml's
/// `roundf`).
pub(super) fn q8_0(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 34]| {
        let d = absmax(x) / 127.0;
        let id = inverse(d);
        put_f16(b, 0, d);
        for (o, &v) in b[2..].iter_mut().zip(x) {
            *o = np_round_byte(v * id);
        }
    });
}
