//! The number type a run computes in: f32 for the reference and the emulated GPU dtypes, f64 for
//! a run that shows how much of a difference is the f32 reference's own rounding.
//!
//! `lane_dot` is f32's fixed summation order, which every CPU kernel follows.

pub mod lane_dot;

use std::fmt::Debug;
use std::iter::Sum;
use std::sync::Arc;

use candle_core::WithDType;

use crate::dtype::Precision;
use crate::trace::{OwnedStage, Stage};

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
    /// Every value as [`Self::round_to`] rounds it.
    fn round_all(xs: &mut [Self], p: Precision) {
        xs.iter_mut().for_each(|x| *x = x.round_to(p));
    }
    /// Largest first, NaN above +∞, as `f32::total_cmp`.
    fn total_cmp(&self, other: &Self) -> std::cmp::Ordering;
    /// The values as a trace stores them.
    fn stage(xs: &[Self]) -> Stage<'_>;
    /// The values as f32, where they are (the kernels written for f32 alone).
    fn as_f32(xs: &[Self]) -> Option<&[f32]>;
    /// [`Self::as_f32`], writable.
    fn as_f32_mut(xs: &mut [Self]) -> Option<&mut [f32]>;
    /// f32 values as this type, where it is f32.
    fn from_f32(xs: &[f32]) -> Option<&[Self]>;
    /// `Σ a[i]·b[i]` in this type's fixed order (f32: in lanes, [`crate::exec::real::lane_dot`]; f64: in
    /// sequence).
    fn dot(a: &[Self], b: &[Self]) -> Self;
    /// [`Self::stage`], shared with the writer.
    fn shared_stage(xs: Arc<Vec<Self>>) -> OwnedStage;
    /// [`Self::stage`], handed over.
    fn owned_stage(xs: Vec<Self>) -> OwnedStage {
        Self::shared_stage(Arc::new(xs))
    }
}

impl Real for f32 {
    fn widen(x: f32) -> Self {
        x
    }
    fn widen_all(xs: Vec<f32>) -> Vec<Self> {
        xs
    }
    fn round_to(self, p: Precision) -> Self {
        p.round_f32(self)
    }
    fn round_all(xs: &mut [Self], p: Precision) {
        p.round_slice_f32(xs)
    }
    fn total_cmp(&self, other: &Self) -> std::cmp::Ordering {
        f32::total_cmp(self, other)
    }
    fn stage(xs: &[Self]) -> Stage<'_> {
        Stage::F32(xs)
    }
    fn as_f32(xs: &[Self]) -> Option<&[f32]> {
        Some(xs)
    }
    fn as_f32_mut(xs: &mut [Self]) -> Option<&mut [f32]> {
        Some(xs)
    }
    fn from_f32(xs: &[f32]) -> Option<&[Self]> {
        Some(xs)
    }
    fn dot(a: &[Self], b: &[Self]) -> Self {
        crate::exec::real::lane_dot::dot(a, b)
    }
    fn shared_stage(xs: Arc<Vec<Self>>) -> OwnedStage {
        OwnedStage::F32(xs)
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
        p.round_f64(self)
    }
    fn total_cmp(&self, other: &Self) -> std::cmp::Ordering {
        f64::total_cmp(self, other)
    }
    fn stage(xs: &[Self]) -> Stage<'_> {
        Stage::F64(xs)
    }
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
    fn from_f32(_: &[f32]) -> Option<&[Self]> {
        None
    }
    fn dot(a: &[Self], b: &[Self]) -> Self {
        a.iter().zip(b).map(|(&x, &y)| x * y).sum()
    }
    fn shared_stage(xs: Arc<Vec<Self>>) -> OwnedStage {
        OwnedStage::F64(xs)
    }
}
