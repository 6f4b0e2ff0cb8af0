//! The k-quants: 256-element super-blocks with an f16 `d` (and `dmin`) and small integer scales
//! per sub-block. Like gguf-py, each sub-block's `d * scale` (and `dmin * min`) is formed in f32
//! first, then every element is `dl * q` (minus `ml`). An f16 has 11 significant bits and scale
//! times code at most 13, so every product is exact: only the subtraction of `ml` rounds.

use super::block::{crumb_rows, f16_at, nibbles, nibbles_at};

/// Q2_K: 16 bytes of 4-bit scale (low) and min (high) per 16 elements, 64 bytes of 2-bit codes,
/// then `d` and `dmin`.
#[inline(always)]
pub(super) fn q2_k(b: &[u8; 84], out: &mut [f32; 256]) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let dl: [f32; 16] = std::array::from_fn(|g| d * f32::from(b[g] & 0x0f));
    let ml: [f32; 16] = std::array::from_fn(|g| dmin * f32::from(b[g] >> 4));
    crumb_rows(&b[16..80], out, |q, row, i| {
        let g = 2 * row + i / 16;
        dl[g] * f32::from(q) - ml[g]
    });
}

/// Q3_K's sixteen 6-bit scales, stored as 4 low bits in bytes 0..8 (low nibbles first) and
/// 2 high bits in bytes 8..12, minus 32.
#[inline(always)]
fn q3_scales(s: &[u8]) -> [i8; 16] {
    std::array::from_fn(|i| {
        let low = (s[i % 8] >> (4 * (i / 8))) & 0x0f;
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        (low | high << 4) as i8 - 32
    })
}

/// Q3_K: 32 bytes of high bits (a set bit means no -4 offset), 64 bytes of 2-bit codes,
/// 12 bytes of scales, then `d`. Row `j` of 32 takes its high bits from bit `j` of each byte.
#[inline(always)]
pub(super) fn q3_k(b: &[u8; 110], out: &mut [f32; 256]) {
    let d = f16_at(b, 108);
    let scales = q3_scales(&b[96..108]);
    let dl: [f32; 16] = std::array::from_fn(|g| d * f32::from(scales[g]));
    crumb_rows(&b[32..96], out, |q, row, i| {
        let offset = (((b[i] >> row) & 1) ^ 1) << 2;
        dl[2 * row + i / 16] * f32::from(q as i8 - offset as i8)
    });
}

/// The eight 6-bit scales and mins of Q4_K/Q5_K, packed in 12 bytes, times `d` and `dmin`.
#[inline(always)]
fn scales_mins(d: f32, dmin: f32, s: &[u8]) -> ([f32; 8], [f32; 8]) {
    let scale = |j: usize| {
        if j < 4 {
            s[j] & 0x3f
        } else {
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30)
        }
    };
    let min = |j: usize| {
        if j < 4 {
            s[j + 4] & 0x3f
        } else {
            (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30)
        }
    };
    (
        std::array::from_fn(|j| d * f32::from(scale(j))),
        std::array::from_fn(|j| dmin * f32::from(min(j))),
    )
}

/// Q4_K: `d`, `dmin`, 12 bytes of scales and mins, then 4-bit codes: each 32 bytes hold two
/// sub-blocks of 32 in ggml's nibble layout.
#[inline(always)]
pub(super) fn q4_k(b: &[u8; 144], out: &mut [f32; 256]) {
    q4_k_by(b, out, scales_mins);
}

/// Q4_K as a dequantizer with a known bug decodes it: sub-blocks 4–7 take their scales and
/// mins as sub-blocks 0–3 are packed (low 6 bits of bytes `j` and `j + 4`). The fault
/// `--inject dequant-q4k-scales` plants; never used for the reference.
#[inline(always)]
pub(super) fn q4_k_misread_upper_scales(b: &[u8; 144], out: &mut [f32; 256]) {
    q4_k_by(b, out, |d, dmin, s| {
        (
            std::array::from_fn(|j| d * f32::from(s[j % 8] & 0x3f)),
            std::array::from_fn(|j| dmin * f32::from(s[(j + 4) % 12] & 0x3f)),
        )
    });
}

#[inline(always)]
fn q4_k_by(
    b: &[u8; 144],
    out: &mut [f32; 256],
    scales: impl Fn(f32, f32, &[u8]) -> ([f32; 8], [f32; 8]),
) {
    let (dl, ml) = scales(f16_at(b, 0), f16_at(b, 2), &b[4..16]);
    for (c, (o, q)) in out
        .chunks_exact_mut(64)
        .zip(b[16..].chunks_exact(32))
        .enumerate()
    {
        let (dl, ml) = ([dl[2 * c], dl[2 * c + 1]], [ml[2 * c], ml[2 * c + 1]]);
        nibbles(q, o, |n, half| dl[half] * f32::from(n) - ml[half]);
    }
}

/// Q5_K: Q4_K plus 32 bytes of fifth bits after the scales: sub-block `j` takes bit `j` of byte
/// `l` for its element `l`.
#[inline(always)]
pub(super) fn q5_k(b: &[u8; 176], out: &mut [f32; 256]) {
    let (dl, ml) = scales_mins(f16_at(b, 0), f16_at(b, 2), &b[4..16]);
    let qh = &b[16..48];
    for (c, (o, q)) in out
        .chunks_exact_mut(64)
        .zip(b[48..].chunks_exact(32))
        .enumerate()
    {
        let (dl, ml) = ([dl[2 * c], dl[2 * c + 1]], [ml[2 * c], ml[2 * c + 1]]);
        nibbles_at(q, o, |n, half, l| {
            let q = n | ((qh[l] >> (2 * c + half)) & 1) << 4;
            dl[half] * f32::from(q) - ml[half]
        });
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 signed scales (one per 16
/// elements), then `d`. Each half of 128 elements is four rows of 32 made from 64 low bytes
/// (rows 0 and 1: low nibbles of bytes 0..32 and 32..64; rows 2 and 3: their high nibbles) and
/// 32 high bytes (row `r` at bits `2r`).
#[inline(always)]
pub(super) fn q6_k(b: &[u8; 210], out: &mut [f32; 256]) {
    let d = f16_at(b, 208);
    let dl: [f32; 16] = std::array::from_fn(|g| d * f32::from(b[192 + g] as i8));
    let halves = b[..128].chunks_exact(64).zip(b[128..192].chunks_exact(32));
    for (h, (o, (ql, qh))) in out.chunks_exact_mut(128).zip(halves).enumerate() {
        for i in 0..32 {
            for r in 0..4 {
                let low = (ql[32 * (r % 2) + i] >> (4 * (r / 2))) & 0x0f;
                let q = low | ((qh[i] >> (2 * r)) & 3) << 4;
                o[32 * r + i] = dl[8 * h + 2 * r + i / 16] * f32::from(q as i8 - 32);
            }
        }
    }
}
