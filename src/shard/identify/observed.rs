//! What a rank says it holds of one weight (its shape, type, and values, hash or statistics)
//! and how closely each must match the plan's slice: one rounding to the type it is held in.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};

use crate::trace::stats::{fnv1a_bytes, TensorStats};

/// Slack on sums (mean, std, l2) for a producer that accumulates in f32 in another order.
const ACCUMULATION: f64 = 1.0 / 65536.0;

/// The element type a rank holds a weight in: the hash is over its bytes, and one rounding to it
/// is the tolerance of a match.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Relative error of one rounding to this type; for f32 one ulp, as an engine's
    /// dequantization may round once where ours does not.
    pub(super) fn rel(self) -> f64 {
        match self {
            Dtype::F32 => f64::powi(2.0, -23),
            Dtype::Bf16 => f64::powi(2.0, -8),
            Dtype::F16 => f64::powi(2.0, -11),
        }
    }

    /// Absolute error of one rounding among the subnormals: half their spacing.
    pub(super) fn floor(self) -> f64 {
        match self {
            Dtype::F32 => f64::powi(2.0, -150),
            Dtype::Bf16 => f64::powi(2.0, -134),
            Dtype::F16 => f64::powi(2.0, -25),
        }
    }

    /// `x` rounded to this type (to nearest, ties to even) and widened back.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::F32 => x,
            Dtype::Bf16 => bf16::from_f32(x).to_f32(),
            Dtype::F16 => f16::from_f32(x).to_f32(),
        }
    }

    /// FNV-1a 64 over the little-endian bytes of `xs` rounded to this type: the manifest's
    /// `hash`.
    pub fn hash(self, xs: &[f32]) -> u64 {
        let bytes: Vec<u8> = match self {
            Dtype::F32 => xs.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dtype::Bf16 => xs
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_le_bytes())
                .collect(),
            Dtype::F16 => xs
                .iter()
                .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                .collect(),
        };
        fnv1a_bytes(&bytes)
    }
}

/// The statistics a manifest gives per shard: [`TensorStats`]'s moments and extremes over the
/// finite values (`std` is the population deviation).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardStats {
    pub count: u64,
    pub mean: f64,
    pub std: f64,
    pub min: f64,
    pub max: f64,
    pub absmax: f64,
    pub l2: f64,
}

impl ShardStats {
    pub fn of(xs: &[f32]) -> ShardStats {
        let s = TensorStats::of(xs);
        ShardStats {
            count: s.count,
            mean: s.mean,
            std: s.std,
            min: s.min,
            max: s.max,
            absmax: s.absmax,
            l2: s.l2,
        }
    }

    /// How far these (observed) statistics are from those of `reference`'s values, in units of
    /// what rounding each value once to `dtype` can move them: at most 1 when the observed
    /// shard may be `reference` in `dtype`. Extremes move by at most one rounding of the
    /// absolute maximum, the mean and deviation by one of the RMS, the norm by one of itself.
    pub fn distance(&self, reference: &ShardStats, dtype: Dtype) -> f64 {
        if self.count != reference.count {
            return f64::INFINITY;
        }
        let (rel, tiny) = (dtype.rel(), f64::MIN_POSITIVE);
        let rms = reference.l2 / (reference.count.max(1) as f64).sqrt();
        let moment = (rel + ACCUMULATION) * rms + tiny;
        let extreme = rel * reference.absmax + dtype.floor();
        let gaps = [
            (self.mean - reference.mean).abs() / moment,
            (self.std - reference.std).abs() / moment,
            (self.l2 - reference.l2).abs() / ((rel + ACCUMULATION) * reference.l2 + tiny),
            (self.min - reference.min).abs() / extreme,
            (self.max - reference.max).abs() / extreme,
            (self.absmax - reference.absmax).abs() / extreme,
        ];
        gaps.into_iter().fold(0.0, |worst, g| {
            if g.is_nan() {
                f64::INFINITY
            } else {
                worst.max(g)
            }
        })
    }
}

/// What a rank says it holds of one weight: its shape and type, and any of its values, its
/// hash in that type, its statistics (the first of these present decides).
#[derive(Clone, Copy, Debug)]
pub struct ObservedShard<'a> {
    pub shape: &'a [u64],
    pub dtype: Dtype,
    pub values: Option<&'a [f32]>,
    pub hash: Option<u64>,
    pub stats: Option<&'a ShardStats>,
}

impl<'a> ObservedShard<'a> {
    /// A shard whose values are at hand (a rank's weight view in a drill-down).
    pub fn values(shape: &'a [u64], dtype: Dtype, values: &'a [f32]) -> Self {
        ObservedShard {
            shape,
            dtype,
            values: Some(values),
            hash: None,
            stats: None,
        }
    }
}
