//! TQ1_0 and TQ2_0: ternary codes {-1, 0, 1} of x / absmax, as ggml's `quantize_row_tq1_0_ref`
//! and `quantize_row_tq2_0_ref` pack them.

use super::block::{c_max, each_block, inverse, lround_low, put_f16};

/// The 256 codes `lroundf(x / absmax) + 1` (in {0, 1, 2} but for degenerate blocks), and the
/// absmax that is `d`.
#[inline(always)]
fn ternary_codes(x: &[f32; 256]) -> ([i32; 256], f32) {
    let d = x.iter().fold(0.0f32, |m, v| c_max(m, v.abs()));
    let id = inverse(d);
    (x.map(|v| lround_low(v * id).wrapping_add(1)), d)
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
                // ggml's uint8_t accumulator: `q = q * 3 + xi`, first code most significant.
                let value = (0..digits).fold(0u8, |acc, i| {
                    acc.wrapping_mul(3)
                        .wrapping_add(q[first + i * bytes + j] as u8)
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
                *o = (0..4).fold(0u8, |acc, i| {
                    acc.wrapping_add(((half[32 * i + j] & 3) << (2 * i)) as u8)
                });
            }
        }
        put_f16(b, 64, d);
    });
}
