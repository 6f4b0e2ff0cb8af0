//! The dtypes a run holds values in, with what comparisons and emulation need of each: the unit
//! roundoff (tolerances), the largest finite value (overflow) and rounding to it.

use half::{bf16, f16};

/// The dtype activations and weights are held in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Precision {
    F64,
    F32,
    Bf16,
    F16,
}

impl Precision {
    /// The precision a trace's `dtype` names.
    pub fn from_name(name: &str) -> anyhow::Result<Precision> {
        <Precision as clap::ValueEnum>::from_str(name, true)
            .map_err(|_| anyhow::anyhow!("`{name}` is not one of f64, f32, bf16, f16"))
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
