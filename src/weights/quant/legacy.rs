//! The first ggml quants: 32 elements per block behind an f16 scale `d` (and, for the `_1` types,
//! an f16 minimum `m`). Values are `d * q`, or `d * q + m` with the product rounded before the sum.

use super::block::{f16_at, nibbles, nibbles_at};

/// Q4_0: `d`, then 16 bytes of 4-bit `q - 8`.
#[inline(always)]
pub(super) fn q4_0(b: &[u8; 18], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    nibbles(&b[2..], out, |n, _| d * f32::from(n as i8 - 8));
}

/// Q4_1: `d`, `m`, then 16 bytes of 4-bit `q`.
#[inline(always)]
pub(super) fn q4_1(b: &[u8; 20], out: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    nibbles(&b[4..], out, |n, _| d * f32::from(n) + m);
}

/// Bit `k` of a byte moved to bit 4 of byte `k`: Q5's fifth bits spread to one byte per element
/// by table, which vectorizes where per-element bit tests did not (2x on Q5_0).
static FIFTH_BITS: [[u8; 8]; 256] = {
    let mut table = [[0; 8]; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut bit = 0;
        while bit < 8 {
            table[byte][bit] = (((byte >> bit) & 1) << 4) as u8;
            bit += 1;
        }
        byte += 1;
    }
    table
};

/// The 5-bit codes of Q5_0/Q5_1 through `f`: bit `i` of the 4 bytes `qh` is the fifth bit of
/// element `i`, and `ql` holds the low four bits in ggml's nibble layout.
#[inline(always)]
fn five_bit(qh: &[u8], ql: &[u8], out: &mut [f32; 32], f: impl Fn(u8) -> f32) {
    let high: [u8; 32] = std::array::from_fn(|i| FIFTH_BITS[usize::from(qh[i / 8])][i % 8]);
    nibbles_at(ql, out, |n, half, i| f(n | high[i + 16 * half]));
}

/// Q5_0: `d`, 4 bytes of fifth bits, 16 bytes of low nibbles; codes are `q - 16`.
#[inline(always)]
pub(super) fn q5_0(b: &[u8; 22], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    five_bit(&b[2..6], &b[6..], out, |q| d * f32::from(q as i8 - 16));
}

/// Q5_1: `d`, `m`, 4 bytes of fifth bits, 16 bytes of low nibbles.
#[inline(always)]
pub(super) fn q5_1(b: &[u8; 24], out: &mut [f32; 32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    five_bit(&b[4..8], &b[8..], out, |q| d * f32::from(q) + m);
}

/// Q8_0: `d`, then 32 signed bytes.
#[inline(always)]
pub(super) fn q8_0(b: &[u8; 34], out: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (o, &x) in out.iter_mut().zip(&b[2..]) {
        *o = f32::from(x as i8) * d;
    }
}
