//! The dtypes a run holds values in, with what comparisons and emulation need of each: the unit
//! roundoff (tolerances), the largest finite value (overflow) and rounding to it.

use half::{bf16, f16};

/// The dtype activations and weights are held in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    F64,
    F32,
    Bf16,
    F16,
}

impl Precision {
    pub const ALL: [Precision; 4] = [
        Precision::F64,
        Precision::F32,
        Precision::Bf16,
        Precision::F16,
    ];

    /// The precision a trace's `dtype` names (in any case).
    pub fn from_name(name: &str) -> anyhow::Result<Precision> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| anyhow::anyhow!("`{name}` is not one of f64, f32, bf16, f16"))
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F64 => "f64",
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// Half the distance from 1 to the next number: the relative error of one rounding.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Precision::F64 => 2f64.powi(-53),
            Precision::F32 => 2f64.powi(-24),
            Precision::Bf16 => 2f64.powi(-8),
            Precision::F16 => 2f64.powi(-11),
        }
    }

    /// The largest finite value; past it a value rounds to ±Inf.
    pub const fn max_finite(self) -> f64 {
        match self {
            Precision::F64 => f64::MAX,
            Precision::F32 => f32::MAX as f64,
            // (2 - 2^-7) · 2^127 and (2 - 2^-10) · 2^15.
            Precision::Bf16 => 3.3895313892515355e38,
            Precision::F16 => 65504.0,
        }
    }

    /// `x` as the nearest value of this dtype (to nearest even; ±Inf past its range).
    pub fn round_f32(self, x: f32) -> f32 {
        match self {
            Precision::F64 | Precision::F32 => x,
            Precision::Bf16 => bf16::from_f32(x).to_f32(),
            Precision::F16 => f16::from_f32(x).to_f32(),
        }
    }

    /// Every value of `xs` as [`Self::round_f32`] rounds it, at memory speed: bf16 by integer
    /// arithmetic the compiler vectorizes, f16 through F16C where the CPU has it. The emulated
    /// bf16/f16 runs round every weight they hold this way.
    pub fn round_slice_f32(self, xs: &mut [f32]) {
        match self {
            Precision::F64 | Precision::F32 => {}
            Precision::Bf16 => round_bf16_slice(xs),
            Precision::F16 => round_f16_slice(xs),
        }
    }

    /// `x` as the nearest value of this dtype, rounded once (not through a truncating f32).
    pub fn round_f64(self, x: f64) -> f64 {
        match self {
            Precision::F64 => x,
            Precision::F32 => f64::from(x as f32),
            // Through f32 rounded to odd: its 16 (13) extra bits keep the tie information that
            // `half`'s own f64 conversions drop (they truncate the low 32 bits first).
            Precision::Bf16 => bf16::from_f32(to_f32_round_odd(x)).to_f64(),
            Precision::F16 => f16::from_f32(to_f32_round_odd(x)).to_f64(),
        }
    }
}

/// `x` as f32 rounded to odd: truncated toward zero, its last bit set when inexact. Rounding
/// that to nearest at a precision two or more bits narrower equals rounding `x` directly.
fn to_f32_round_odd(x: f64) -> f32 {
    let nearest = x as f32;
    if !x.is_finite() || f64::from(nearest) == x {
        return nearest;
    }
    let toward_zero = if f64::from(nearest).abs() > x.abs() {
        f32::from_bits(nearest.to_bits() - 1)
    } else {
        nearest
    };
    f32::from_bits(toward_zero.to_bits() | 1)
}

/// Every value of `xs` rounded to bf16, sixteen at a time where the CPU has AVX-512, eight
/// where it has AVX2: copies of the same loop compiled for them (the baseline's four lanes ran
/// at 4.7 G values/s on one core, half the rate a Q4_K weight decodes at, so the emulated bf16
/// run's rounding of each decoded row cost more than decoding it; with AVX2 the rounding was
/// still a third of a bf16 generation's time). Integer operations only, so every copy gives
/// the same bits.
fn round_bf16_slice(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            // SAFETY: the CPU has AVX-512 F and BW.
            return unsafe { round_bf16_slice_avx512(xs) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { round_bf16_slice_avx2(xs) };
        }
    }
    round_bf16_each(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn round_bf16_slice_avx512(xs: &mut [f32]) {
    round_bf16_each(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn round_bf16_slice_avx2(xs: &mut [f32]) {
    round_bf16_each(xs)
}

#[inline(always)]
fn round_bf16_each(xs: &mut [f32]) {
    for x in xs {
        *x = f32::from_bits(bf16_rounded_bits(x.to_bits()));
    }
}

/// Every value of `xs` rounded to f16: eight at a time through F16C's conversions there and
/// back where the CPU has them (to nearest, ties to even, as `half` rounds; 2.4 G values/s
/// through `half`'s slice conversions on one core), else through `half`.
fn round_f16_slice(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has AVX and F16C.
        unsafe { round_f16_slice_f16c(xs) };
        return;
    }
    round_f16_with_half(xs)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
fn round_f16_slice_f16c(xs: &mut [f32]) {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps};
    let mut eights = xs.chunks_exact_mut(8);
    for eight in &mut eights {
        // SAFETY: eight values read and written in place; 0 rounds to nearest, ties to even.
        unsafe {
            let halves = _mm256_cvtps_ph::<0>(_mm256_loadu_ps(eight.as_ptr()));
            _mm256_storeu_ps(eight.as_mut_ptr(), _mm256_cvtph_ps(halves));
        }
    }
    round_f16_with_half(eights.into_remainder());
}

fn round_f16_with_half(xs: &mut [f32]) {
    for x in xs {
        *x = f16::from_f32(*x).to_f32();
    }
}

/// The f32 bits `x` rounded to bf16 (to nearest, ties to even; a NaN stays a NaN, made quiet),
/// as f32 bits: what `half::bf16::from_f32` gives, without a branch.
fn bf16_rounded_bits(x: u32) -> u32 {
    let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) & 0xffff_0000;
    let quiet_nan = (x | 0x0040_0000) & 0xffff_0000;
    if x & 0x7fff_ffff > 0x7f80_0000 {
        quiet_nan
    } else {
        rounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f64_rounds_to_half_precision_directly_not_through_truncation() {
        // Just above the halfway point between 87 and 87.5 (bf16) and between two f16 values:
        // `half`'s own f64 conversions round these down.
        let x = f64::from(f32::from_bits(0x42ae_8007));
        assert_eq!(Precision::Bf16.round_f64(x), 87.5);
        let y = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(Precision::F16.round_f64(y), 1.0 + 2f64.powi(-10));
        assert_eq!(Precision::Bf16.round_f64(-x), -87.5);
        // Exact ties still go to even.
        assert_eq!(Precision::Bf16.round_f64(87.25), 87.0);
        assert_eq!(Precision::Bf16.round_f64(f64::MAX), f64::INFINITY);
    }

    #[test]
    fn slices_round_as_single_values_do() {
        // Every exponent with low mantissa patterns around the rounding point (ties, just above
        // and below), NaNs with payloads, infinities, zeros, subnormals, the largest finites,
        // and a sweep of pseudo-random bit patterns.
        let mut bits: Vec<u32> = Vec::new();
        for sign in [0u32, 0x8000_0000] {
            for exp in 0..=255u32 {
                for low in [
                    0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1_7fff, 0x1_8000, 0x7f_ffff,
                ] {
                    bits.push(sign | exp << 23 | low);
                }
            }
        }
        let mut state = 0x9e37_79b9u32;
        for _ in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            bits.push(state);
        }
        for p in [Precision::Bf16, Precision::F16, Precision::F32] {
            let mut xs: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            p.round_slice_f32(&mut xs);
            // The copy without AVX2 too, wherever the test runs.
            let mut plain: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            match p {
                Precision::Bf16 => round_bf16_each(&mut plain),
                Precision::F16 => round_f16_with_half(&mut plain),
                _ => p.round_slice_f32(&mut plain),
            }
            // And the AVX2 copy where the dispatch took AVX-512.
            let mut eights: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
            #[cfg(target_arch = "x86_64")]
            if p == Precision::Bf16 && std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2.
                unsafe { round_bf16_slice_avx2(&mut eights) };
            } else {
                p.round_slice_f32(&mut eights);
            }
            for (((&b, x), y), z) in bits.iter().zip(&xs).zip(&plain).zip(&eights) {
                let one = p.round_f32(f32::from_bits(b));
                assert_eq!(one.to_bits(), x.to_bits(), "{p:?} {b:#010x}");
                assert_eq!(one.to_bits(), y.to_bits(), "{p:?} {b:#010x}, plain");
                assert_eq!(one.to_bits(), z.to_bits(), "{p:?} {b:#010x}, AVX2");
            }
        }
    }

    #[test]
    fn the_range_and_roundoff_are_the_half_crates() {
        assert_eq!(Precision::Bf16.max_finite(), f64::from(bf16::MAX.to_f32()));
        assert_eq!(Precision::F16.max_finite(), f64::from(f16::MAX.to_f32()));
        assert_eq!(
            Precision::F16.unit_roundoff(),
            f64::from(f16::EPSILON.to_f32()) / 2.0
        );
        assert_eq!(
            Precision::Bf16.unit_roundoff(),
            f64::from(bf16::EPSILON.to_f32()) / 2.0
        );
        assert_eq!(
            Precision::F32.unit_roundoff(),
            f64::from(f32::EPSILON) / 2.0
        );
        assert_eq!(Precision::F64.unit_roundoff(), f64::EPSILON / 2.0);
        for p in [
            Precision::F64,
            Precision::F32,
            Precision::Bf16,
            Precision::F16,
        ] {
            assert_eq!(Precision::from_name(p.name()).unwrap(), p);
        }
    }
}
