//! What the block encoders share: walking blocks as fixed-size arrays, numpy's arithmetic quirks
//! (its float to byte cast, its round-half-away), and ggml's f16 and 4-bit fields.

use half::f16;

/// Calls `encode` on each `BS`-value block and its `TS` bytes. The caller has checked that both
/// slices hold whole blocks; fixed-size arrays let the compiler drop bounds checks.
#[inline(always)]
pub(super) fn each_block<const BS: usize, const TS: usize, F: Fn(&[f32; BS], &mut [u8; TS])>(
    src: &[f32],
    dst: &mut [u8],
    encode: F,
) {
    for (x, b) in src.chunks_exact(BS).zip(dst.chunks_exact_mut(TS)) {
        // `chunks_exact` makes both conversions infallible.
        if let (Ok(x), Ok(b)) = (x.try_into(), b.try_into()) {
            encode(x, b);
        }
    }
}

/// `v` as f16 (round to nearest even, overflow to infinity, as numpy's `astype`) at byte `at`.
#[inline(always)]
pub(super) fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The f32 value of `v` after a round trip through f16: what a dequantizer will read.
#[inline(always)]
pub(super) fn through_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// `1 / d`, or 0 where `d` is 0: gguf-py's `np.where(d == 0, 0, 1 / d)`.
#[inline(always)]
pub(super) fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// The largest magnitude in `x`.
#[inline(always)]
pub(super) fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The element of largest magnitude, sign kept; the first of equals, as numpy's `argmax`.
#[inline(always)]
pub(super) fn signed_absmax(x: &[f32]) -> f32 {
    x.iter()
        .fold(x[0], |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// The smallest and largest values as numpy's `min` and `max` reduce them, where of equal values
/// (0 and -0) the later one wins.
#[inline(always)]
pub(super) fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((x[0], x[0]), |(lo, hi), &v| {
        (if lo < v { lo } else { v }, if hi > v { hi } else { v })
    })
}

/// numpy's float32 to uint8/int8 cast on x86-64: truncation to i32 (NaN and out-of-range values
/// become `i32::MIN`), then the low byte. Only degenerate inputs (infinite or NaN products of
/// subnormal scales) reach the out-of-range cases, but gguf-py's bytes are the reference there too.
#[inline(always)]
pub(super) fn np_byte(v: f32) -> u8 {
    truncated(v).unwrap_or(i32::MIN) as u8
}

/// gguf-py's `np_roundf` (round half away from zero; NaN for infinities) followed by numpy's cast
/// to a byte, without the `roundf`/`floorf` library calls that baseline x86-64 needs.
#[inline(always)]
pub(super) fn np_round_byte(v: f32) -> u8 {
    let Some(t) = truncated(v) else {
        return i32::MIN as u8;
    };
    // Exact: below 2^23 the fraction is representable, above it `v` is a whole number.
    let frac = v - t as f32;
    (t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)) as u8
}

/// `v` truncated toward zero when it is in i32's range.
#[inline(always)]
fn truncated(v: f32) -> Option<i32> {
    const LIMIT: f32 = 2_147_483_648.0;
    (-LIMIT..LIMIT).contains(&v).then_some(v as i32)
}

/// ggml's 4-bit layout of 32 codes: code j in the low nibble of byte j, code j + 16 in the high
/// nibble.
#[inline(always)]
pub(super) fn pack_nibbles(q: &[u8; 32], out: &mut [u8]) {
    for (j, o) in out[..16].iter_mut().enumerate() {
        *o = (q[j] & 0x0f) | (q[j + 16] << 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gguf-py's `np_roundf` step for step.
    fn np_roundf(n: f32) -> f32 {
        let a = n.abs();
        let floored = a.floor();
        n.signum() * (floored + (2.0 * (a - floored)).floor())
    }

    #[test]
    fn round_byte_is_np_roundf_then_cast() {
        let special = [
            0.5, 1.5, 2.5, 126.5, 127.49999, 0.49999997, 8388607.5, 8388609.0, 3e9,
        ];
        let mut xs: Vec<f32> = special.iter().flat_map(|&v| [v, -v]).collect();
        xs.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
        ]);
        xs.extend((0..100_000).map(|i| (i as f32 - 50_000.0) * 0.0131));
        for x in xs {
            assert_eq!(np_round_byte(x), np_byte(np_roundf(x)), "{x}");
        }
    }
}
