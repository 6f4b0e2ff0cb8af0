//! The ternary quants TQ1_0 and TQ2_0: 256 values in {-1, 0, 1} times an f16 `d` at the end.

use super::block::{crumb_rows, f16_at};

/// One trit of a TQ1_0 byte, which packs five as a base-3 fraction of 256: multiplying by 3^p
/// (wrapping) moves digit `p` to the top, and the top bits of three times that are the digit.
#[inline(always)]
fn trit(byte: u8, pow3: u8) -> i8 {
    ((u16::from(byte.wrapping_mul(pow3)) * 3) >> 8) as i8 - 1
}

/// Digits of `q` in ggml's order: the first digit of every byte, then the second, and so on.
#[inline(always)]
fn trits(d: f32, q: &[u8], out: &mut [f32]) {
    for (o, pow3) in out.chunks_exact_mut(q.len()).zip([1, 3, 9, 27, 81]) {
        for (o, &b) in o.iter_mut().zip(q) {
            *o = d * f32::from(trit(b, pow3));
        }
    }
}

/// TQ1_0: 32 bytes of five trits (160 values), 16 more (80), 4 bytes of four trits (16), `d`.
#[inline(always)]
pub(super) fn tq1_0(b: &[u8; 54], out: &mut [f32; 256]) {
    let d = f16_at(b, 52);
    let (first, rest) = out.split_at_mut(160);
    let (second, third) = rest.split_at_mut(80);
    trits(d, &b[..32], first);
    trits(d, &b[32..48], second);
    trits(d, &b[48..52], third);
}

/// TQ2_0: 64 bytes of 2-bit codes `q + 1` in ggml's 2-bit layout, then `d`.
#[inline(always)]
pub(super) fn tq2_0(b: &[u8; 66], out: &mut [f32; 256]) {
    let d = f16_at(b, 64);
    crumb_rows(&b[..64], out, |q, _, _| d * f32::from(q as i8 - 1));
}
