//! The number type a run computes in: f32 for the reference and the emulated GPU dtypes, f64 for
//! a run that shows how much of a difference is the f32 reference's own rounding.

use std::fmt::Debug;
use std::iter::Sum;

use candle_core::WithDType;
use half::{bf16, f16};

use super::backend::Precision;
use crate::trace::Stage;

pub trait Real: num_traits::Float + WithDType + Sum + Default + Debug {
    /// `x` exactly (every f32 is an f64).
    fn widen(x: f32) -> Self;
    /// Every value widened; f32 data is taken as it is, without a copy.
    fn widen_all(xs: Vec<f32>) -> Vec<Self>;
    /// A constant of the math, as this type holds it.
    fn lit(x: f64) -> Self {
        <Self as WithDType>::from_f64(x)
    }
    /// `x` as the nearest value of `p` (round to nearest even; ±Inf past f16's range).
    fn round_to(self, p: Precision) -> Self;
    /// Largest first, NaN above +∞, as `f32::total_cmp`.
    fn total_cmp(&self, other: &Self) -> std::cmp::Ordering;
    /// The values as a trace stores them.
    fn stage(xs: &[Self]) -> Stage<'_>;
}

impl Real for f32 {
    fn widen(x: f32) -> Self {
        x
    }
    fn widen_all(xs: Vec<f32>) -> Vec<Self> {
        xs
    }
    fn round_to(self, p: Precision) -> Self {
        match p {
            Precision::F64 | Precision::F32 => self,
            Precision::Bf16 => bf16::from_f32(self).to_f32(),
            Precision::F16 => f16::from_f32(self).to_f32(),
        }
    }
    fn total_cmp(&self, other: &Self) -> std::cmp::Ordering {
        f32::total_cmp(self, other)
    }
    fn stage(xs: &[Self]) -> Stage<'_> {
        Stage::F32(xs)
    }
}

impl Real for f64 {
    fn widen(x: f32) -> Self {
        f64::from(x)
    }
    fn widen_all(xs: Vec<f32>) -> Vec<Self> {
        xs.into_iter().map(f64::from).collect()
    }
    fn round_to(self, p: Precision) -> Self {
        match p {
            Precision::F64 => self,
            Precision::F32 => f64::from(self as f32),
            // Through f32 rounded to odd: its 16 (13) extra bits keep the tie information that
            // `half`'s own f64 conversions drop (they truncate the low 32 bits first).
            Precision::Bf16 => bf16::from_f32(to_f32_round_odd(self)).to_f64(),
            Precision::F16 => f16::from_f32(to_f32_round_odd(self)).to_f64(),
        }
    }
    fn total_cmp(&self, other: &Self) -> std::cmp::Ordering {
        f64::total_cmp(self, other)
    }
    fn stage(xs: &[Self]) -> Stage<'_> {
        Stage::F64(xs)
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
        assert_eq!(x.round_to(Precision::Bf16), 87.5);
        let y = 1.0 + 2f64.powi(-11) + 2f64.powi(-40);
        assert_eq!(y.round_to(Precision::F16), 1.0 + 2f64.powi(-10));
        assert_eq!((-x).round_to(Precision::Bf16), -87.5);
        // Exact ties still go to even.
        assert_eq!(87.25f64.round_to(Precision::Bf16), 87.0);
        assert_eq!(f64::MAX.round_to(Precision::Bf16), f64::INFINITY);
    }
}
