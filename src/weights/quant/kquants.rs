//! The k-quants: 256-element super-blocks with an f16 `d` (and `dmin`) and small integer scales
//! per sub-block. Like gguf-py, each sub-block's `d * scale` (and `dmin * min`) is rounded to f32
//! first, then every element is `dl * q` (minus `ml`, after rounding the product).

use super::block::{crumb_group, each_block, f16_at, nibbles, nibbles_at};

/// Q2_K: 16 bytes of 4-bit scale (low) and min (high) per 16 elements, 64 bytes of 2-bit codes,
/// then `d` and `dmin`.
pub(super) fn q2_k(src: &[u8], dst: &mut [f32]) {
    each_block(src, dst, |b: &[u8; 84], out: &mut [f32; 256]| {
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        for (g, (o, &sc)) in out.chunks_exact_mut(16).zip(&b[..16]).enumerate() {
            let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
            let (q, shift) = crumb_group(&b[16..80], g);
            for (o, &q) in o.iter_mut().zip(q) {
                *o = dl * f32::from((q >> shift) & 3) - ml;
            }
        }
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
/// 12 bytes of scales, then `d`.
pub(super) fn q3_k(src: &[u8], dst: &mut [f32]) {
    each_block(src, dst, |b: &[u8; 110], out: &mut [f32; 256]| {
        let d = f16_at(b, 108);
        let scales = q3_scales(&b[96..108]);
        for (g, (o, &s)) in out.chunks_exact_mut(16).zip(&scales).enumerate() {
            let dl = d * f32::from(s);
            let (q, shift) = crumb_group(&b[32..96], g);
            // Element 32j + l takes its high bit from bit j of byte l.
            let (hmask, bit) = (&b[g % 2 * 16..][..16], g / 2);
            for ((o, &q), &h) in o.iter_mut().zip(q).zip(hmask) {
                let offset = (((h >> bit) & 1) ^ 1) << 2;
                *o = dl * f32::from(((q >> shift) & 3) as i8 - offset as i8);
            }
        }
    });
}

/// The eight 6-bit scales and mins of Q4_K/Q5_K, packed in 12 bytes, times `d` and `dmin`.
#[inline(always)]
fn scales_mins(d: f32, dmin: f32, s: &[u8]) -> ([f32; 8], [f32; 8]) {
    let scale = |j: usize| if j < 4 { s[j] & 0x3f } else { (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30) };
    let min = |j: usize| if j < 4 { s[j + 4] & 0x3f } else { (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30) };
    (std::array::from_fn(|j| d * f32::from(scale(j))), std::array::from_fn(|j| dmin * f32::from(min(j))))
}

/// Q4_K: `d`, `dmin`, 12 bytes of scales and mins, then 4-bit codes: each 32 bytes hold two
/// sub-blocks of 32 in ggml's nibble layout.
pub(super) fn q4_k(src: &[u8], dst: &mut [f32]) {
    each_block(src, dst, |b: &[u8; 144], out: &mut [f32; 256]| {
        let (dl, ml) = scales_mins(f16_at(b, 0), f16_at(b, 2), &b[4..16]);
        for (c, (o, q)) in out.chunks_exact_mut(64).zip(b[16..].chunks_exact(32)).enumerate() {
            let (dl, ml) = ([dl[2 * c], dl[2 * c + 1]], [ml[2 * c], ml[2 * c + 1]]);
            nibbles(q, o, |n, half| dl[half] * f32::from(n) - ml[half]);
        }
    });
}

/// Q5_K: Q4_K plus 32 bytes of fifth bits after the scales: sub-block `j` takes bit `j` of byte
/// `l` for its element `l`.
pub(super) fn q5_k(src: &[u8], dst: &mut [f32]) {
    each_block(src, dst, |b: &[u8; 176], out: &mut [f32; 256]| {
        let (dl, ml) = scales_mins(f16_at(b, 0), f16_at(b, 2), &b[4..16]);
        let qh = &b[16..48];
        for (c, (o, q)) in out.chunks_exact_mut(64).zip(b[48..].chunks_exact(32)).enumerate() {
            let (dl, ml) = ([dl[2 * c], dl[2 * c + 1]], [ml[2 * c], ml[2 * c + 1]]);
            nibbles_at(q, o, |n, half, l| {
                let q = n | ((qh[l] >> (2 * c + half)) & 1) << 4;
                dl[half] * f32::from(q) - ml[half]
            });
        }
    });
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 signed scales (one per 16
/// elements), then `d`. Each half of 128 elements takes 64 low bytes (four rows of 32: low
/// nibbles of bytes 0..32, of 32..64, then high nibbles) and 32 high bytes (row `r` at bits `2r`).
pub(super) fn q6_k(src: &[u8], dst: &mut [f32]) {
    each_block(src, dst, |b: &[u8; 210], out: &mut [f32; 256]| {
        let d = f16_at(b, 208);
        for (g, (o, &s)) in out.chunks_exact_mut(16).zip(&b[192..208]).enumerate() {
            let dl = d * f32::from(s as i8);
            let (half, row, part) = (g / 8, g / 2 % 4, g % 2);
            let ql = &b[half * 64 + row % 2 * 32 + part * 16..][..16];
            let qh = &b[128 + half * 32 + part * 16..][..16];
            let (lshift, hshift) = (row / 2 * 4, row * 2);
            for ((o, &l), &h) in o.iter_mut().zip(ql).zip(qh) {
                let q = ((l >> lshift) & 0x0f) | ((h >> hshift) & 3) << 4;
                *o = dl * f32::from(q as i8 - 32);
            }
        }
    });
}
