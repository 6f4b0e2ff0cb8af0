//! The ops of the forward, and the precision they run at.
//!
//! The CPU reference runs every op in f32. Its bf16 and f16 modes emulate a GPU engine: weights
//! are held in the dtype, each op accumulates in f32 and rounds its output to the dtype (what
//! cuBLAS GEMMs with f32 accumulation and fused norm kernels do), while the router stays in f32
//! as GLM-5 engines keep it. The difference between the f32 and the emulated runs is the noise
//! envelope a candidate at that dtype is judged against.

use anyhow::Result;
use half::{bf16, f16};

use super::mat::Mat;
use super::ops;

/// The dtype activations and weights are held in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// `x` as the nearest value of the dtype (round to nearest even; ±Inf past f16's range).
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::F32 => x,
            Precision::Bf16 => bf16::from_f32(x).to_f32(),
            Precision::F16 => f16::from_f32(x).to_f32(),
        }
    }

    pub fn round_all(self, xs: &mut [f32]) {
        if self != Precision::F32 {
            xs.iter_mut().for_each(|x| *x = self.round(*x));
        }
    }

    fn mat(self, mut m: Mat) -> Mat {
        self.round_all(&mut m.data);
        m
    }
}

/// The CPU backend at a precision.
#[derive(Clone, Copy, Debug)]
pub struct Cpu {
    pub precision: Precision,
}

impl Cpu {
    /// `x · wᵀ`, accumulated in f32, rounded to the precision.
    pub fn linear(&self, x: &Mat, w: &Mat) -> Result<Mat> {
        Ok(self.precision.mat(x.linear(w)?))
    }

    /// `x · wᵀ` kept in f32 (the router).
    pub fn linear_f32(&self, x: &Mat, w: &Mat) -> Result<Mat> {
        x.linear(w)
    }

    pub fn rms_norm(&self, x: &Mat, w: &[f32], eps: f64) -> Mat {
        self.precision.mat(ops::rms_norm(x, w, eps))
    }

    pub fn layer_norm(&self, x: &Mat, w: &[f32], b: &[f32], eps: f64) -> Mat {
        self.precision.mat(ops::layer_norm(x, w, b, eps))
    }

    pub fn silu_mul(&self, gate: &Mat, up: &Mat) -> Mat {
        self.precision.mat(ops::silu_mul(gate, up))
    }

    /// A residual add, the sum held in the precision.
    pub fn add(&self, a: &Mat, b: &Mat) -> Mat {
        self.precision.mat(a.add(b))
    }

    /// Round values produced outside these ops (RoPE, attention context, weighted expert sums).
    pub fn round(&self, xs: &mut [f32]) {
        self.precision.round_all(xs);
    }
}
