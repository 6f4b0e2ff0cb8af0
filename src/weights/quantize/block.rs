//! What the block encoders share: walking blocks as fixed-size arrays, and ggml's scalar
//! building blocks as its C code evaluates them on x86-64: its f32 to f16 conversion, its
//! `nearest_int` rounding trick, and C's float to integer conversions.
//!
//! C leaves out-of-range float to integer conversions undefined; x86-64 compilers emit
//! `cvttss2si`, which gives the "integer indefinite" value (the type's minimum) for NaN and
//! out-of-range inputs, and narrower integer types take the low bits of that 32- or 64-bit
//! result. The helpers here reproduce that, so that even degenerate blocks (infinite inverse
//! scales of subnormal blocks) come out as ggml writes them.

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

/// The `N`-value group `j` of a block.
#[inline(always)]
pub(super) fn group<const BS: usize, const N: usize>(x: &[f32; BS], j: usize) -> &[f32; N] {
    let g: &[f32] = &x[N * j..N * (j + 1)];
    g.try_into()
        .unwrap_or_else(|_| unreachable!("a group of {N} lies inside the block"))
}

/// ggml's `GGML_FP32_TO_FP16`: round to nearest even with the exponent-bias trick of its
/// portable conversion (every NaN becomes the quiet NaN 0x7e00 with the input's sign).
#[inline(always)]
pub(super) fn f16_bits(f: f32) -> u16 {
    const SCALE_TO_INF: f32 = f32::from_bits(0x7780_0000); // 2^112
    const SCALE_TO_ZERO: f32 = f32::from_bits(0x0880_0000); // 2^-110
    let mut base = (f.abs() * SCALE_TO_INF) * SCALE_TO_ZERO;
    let w = f.to_bits();
    let shl1_w = w.wrapping_add(w);
    let sign = w & 0x8000_0000;
    let bias = (shl1_w & 0xff00_0000).max(0x7100_0000);
    base += f32::from_bits((bias >> 1) + 0x0780_0000);
    let bits = base.to_bits();
    let nonsign = ((bits >> 13) & 0x7c00) + (bits & 0x0fff);
    ((sign >> 16)
        | if shl1_w > 0xff00_0000 {
            0x7e00
        } else {
            nonsign
        }) as u16
}

/// The f32 value of f16 bits (exact, as ggml's `GGML_FP16_TO_FP32`).
#[inline(always)]
pub(super) fn f16_value(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// `v` as ggml stores an f16 field, at byte `at`; returns the stored bits.
#[inline(always)]
pub(super) fn put_f16(b: &mut [u8], at: usize, v: f32) -> u16 {
    let h = f16_bits(v);
    b[at..at + 2].copy_from_slice(&h.to_le_bytes());
    h
}

/// C's `d ? 1.0f/d : 0.0f` (NaN counts as true).
#[inline(always)]
pub(super) fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// C's `MAX(a, b)`, `a > b ? a : b`, as ggml folds absolute maxima with it.
#[inline(always)]
pub(super) fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// ggml's `nearest_int`: round to nearest (ties to even) by adding 1.5 · 2^23 and reading the
/// mantissa. Exact for |v| < 2^22; outside that range it returns the same bits ggml gets.
#[inline(always)]
pub(super) fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// C's `(int)v` on x86-64: truncation, and `i32::MIN` for NaN and out-of-range values.
#[inline(always)]
pub(super) fn c_int(v: f32) -> i32 {
    const LIMIT: f32 = 2_147_483_648.0;
    if (-LIMIT..LIMIT).contains(&v) {
        v as i32
    } else {
        i32::MIN
    }
}

/// C's `(int8_t)v`: the low byte of [`c_int`].
#[inline(always)]
pub(super) fn c_i8(v: f32) -> i8 {
    c_int(v) as i8
}

/// C's `(uint8_t)v`: the low byte of [`c_int`].
#[inline(always)]
pub(super) fn c_u8(v: f32) -> u8 {
    c_int(v) as u8
}

/// C's `(int8_t)roundf(v)`: rounded half away from zero, then the low byte of [`c_int`];
/// without the `roundf` library call that baseline x86-64 needs.
#[inline(always)]
pub(super) fn round_i8(v: f32) -> i8 {
    const LIMIT: f32 = 2_147_483_648.0;
    if !(-LIMIT..LIMIT).contains(&v) {
        return i32::MIN as i8;
    }
    let t = v as i32;
    // Exact: below 2^23 the fraction is representable, above it `v` is a whole number.
    let frac = v - t as f32;
    (t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)) as i8
}

/// The low 32 bits of C's `lroundf(v)` (glibc on x86-64: half away from zero, `i64::MIN` for
/// NaN and values out of i64's range).
#[inline(always)]
pub(super) fn lround_low(v: f32) -> i32 {
    const LIMIT: f32 = 9_223_372_036_854_775_808.0;
    if !(-LIMIT..LIMIT).contains(&v) {
        return i64::MIN as i32;
    }
    let t = v as i64;
    let frac = v - t as f32;
    (t + i64::from(frac >= 0.5) - i64::from(frac <= -0.5)) as i32
}

/// The first value of greatest magnitude, sign kept: ggml's
/// `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` from `amax = max = 0`.
#[inline(always)]
pub(super) fn signed_absmax_first(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// ggml's `if (ax > amax) { amax = ax; max = x[i]; }` from `amax = max = 0`: the block's
/// absolute and signed extremes.
#[inline(always)]
pub(super) fn abs_and_signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    (amax, max)
}

/// ggml's 4-bit layout of 32 codes: code j in the low nibble of byte j, code j + 16 in the high
/// nibble, as `q[j] | q[j + 16] << 4` (not masked: a code above 15, which only degenerate
/// blocks give, leaks into the high nibble as it does in ggml).
#[inline(always)]
pub(super) fn pack_nibbles(q: &[u8; 32], out: &mut [u8]) {
    for (j, o) in out[..16].iter_mut().enumerate() {
        *o = q[j] | (q[j + 16] << 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_i8_rounds_half_away_then_casts() {
        let special = [
            0.5, 1.5, 2.5, 126.5, 127.49999, 0.49999997, 8388607.5, 8388609.0, 3e9,
        ];
        let mut xs: Vec<f32> = special.iter().flat_map(|&v| [v, -v]).collect();
        xs.extend([0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
        xs.extend((0..100_000).map(|i| (i as f32 - 50_000.0) * 0.0131));
        for x in xs {
            let want = c_int(x.round()) as i8;
            assert_eq!(round_i8(x), want, "{x}");
            let want = if x.is_finite() && x.abs() < 9.2e18 {
                x.round() as i64 as i32
            } else {
                i64::MIN as i32
            };
            assert_eq!(lround_low(x), want, "{x}");
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        for (v, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
        ] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
        for i in -100_000..100_000 {
            let v = i as f32 * 0.173;
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    /// Every finite f32 that is not NaN converts as `half` converts it (round to nearest even);
    /// NaNs all become 0x7e00 with their sign.
    #[test]
    fn f16_conversion_is_round_to_nearest_even() {
        let mut bits = 0u32;
        loop {
            let f = f32::from_bits(bits);
            let want = if f.is_nan() {
                ((bits >> 16) & 0x8000) as u16 | 0x7e00
            } else {
                half::f16::from_f32(f).to_bits()
            };
            assert_eq!(f16_bits(f), want, "{bits:#010x}");
            match bits.checked_add(0x0000_1001) {
                Some(b) => bits = b,
                None => break,
            }
        }
    }
}
