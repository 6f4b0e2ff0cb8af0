//! TQ1_0 and TQ2_0: ternary codes {-1, 0, 1} of x / absmax, as gguf-py packs them.

use super::block::{absmax, each_block, inverse, np_round_byte, put_f16};

/// The 256 codes `roundf(x / absmax) + 1` in {0, 1, 2}, and the absmax that is `d`.
#[inline(always)]
fn ternary_codes(x: &[f32; 256]) -> ([u8; 256], f32) {
    let d = absmax(x);
    let id = inverse(d);
    (x.map(|v| np_round_byte(v * id).wrapping_add(1)), d)
}

/// TQ1_0: five codes a byte in base 3 (160 codes in 32 bytes, 80 in 16), then four a byte (16
/// in 4), each byte scaled to `ceil(value · 256 / 243)`; `d` last.
pub(super) fn tq1_0(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 54]| {
        let (q, d) = ternary_codes(x);
        // (first code, codes per byte, bytes): code i of byte j is q[first + i · bytes + j].
        let groups = [(0, 5, 32), (160, 5, 16), (240, 4, 4)];
        let mut at = 0;
        for (first, digits, bytes) in groups {
            for j in 0..bytes {
                let value = (0..digits).fold(0u8, |acc, i| {
                    acc.wrapping_mul(3).wrapping_add(q[first + i * bytes + j])
                });
                // Four-digit bytes hold their digits as the top four of five.
                let value = if digits == 4 {
                    value.wrapping_mul(3)
                } else {
                    value
                };
                b[at] = (u16::from(value) * 256).div_ceil(243) as u8;
                at += 1;
            }
        }
        put_f16(b, 52, d);
    });
}

/// TQ2_0: four 2-bit codes a byte (code i of byte j is q[32 · i + j] within each 128), `d` last.
pub(super) fn tq2_0(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 66]| {
        let (q, d) = ternary_codes(x);
        for (half, out) in q.chunks_exact(128).zip(b.chunks_exact_mut(32)) {
            for (j, o) in out.iter_mut().enumerate() {
                *o = (0..4).fold(0u8, |acc, i| acc | (half[32 * i + j] << (2 * i)));
            }
        }
        put_f16(b, 64, d);
    });
}
