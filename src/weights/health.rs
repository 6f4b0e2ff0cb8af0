//! Weight health: the statistics that show a broken dequantization or a poisoned weight (NaN/Inf,
//! values past the fp16 or bf16 range, outliers), computed chunk by chunk in parallel so that
//! memory stays at one chunk whatever the tensor's size.

use rayon::prelude::*;
use serde::Serialize;

use super::{ModelFiles, Result, TensorEntry, WeightError};

/// Largest finite f16.
pub const F16_MAX: f64 = crate::dtype::Precision::F16.max_finite();
/// Largest finite bf16.
pub const BF16_MAX: f64 = crate::dtype::Precision::Bf16.max_finite();
/// An element is an outlier when it lies this many standard deviations from the mean.
pub const OUTLIER_SIGMAS: f64 = 8.0;
/// Elements per parallel task.
const TASK: usize = 1 << 16;
/// Independent accumulators per task.
const LANES: usize = 8;

/// Statistics of one tensor's dequantized values.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Health {
    pub count: u64,
    pub nan: u64,
    pub inf: u64,
    pub zeros: u64,
    /// Over finite elements.
    pub mean: f64,
    pub std: f64,
    pub min: f64,
    pub max: f64,
    pub absmax: f64,
    /// Finite elements beyond ±65504 (they become Inf in fp16).
    pub beyond_f16: u64,
    /// absmax / 65504: above 1 the weight cannot be held in fp16.
    pub f16_headroom: f64,
    pub bf16_headroom: f64,
    /// Finite elements more than [`OUTLIER_SIGMAS`] standard deviations from the mean.
    pub outliers: u64,
    /// The largest |x − mean| / std.
    pub max_sigma: f64,
}

impl Health {
    /// Whether the tensor holds NaN or Inf.
    pub fn poisoned(&self) -> bool {
        self.nan > 0 || self.inf > 0
    }
}

/// Sums over a set of elements; two sets merge by adding.
#[derive(Clone, Copy)]
struct Moments {
    count: u64,
    finite: u64,
    nan: u64,
    inf: u64,
    zeros: u64,
    beyond_f16: u64,
    sum: f64,
    sum_sq: f64,
    min: f64,
    max: f64,
}

impl Moments {
    const EMPTY: Moments = Moments {
        count: 0,
        finite: 0,
        nan: 0,
        inf: 0,
        zeros: 0,
        beyond_f16: 0,
        sum: 0.0,
        sum_sq: 0.0,
        min: f64::INFINITY,
        max: f64::NEG_INFINITY,
    };

    fn of(xs: &[f32]) -> Moments {
        xs.par_chunks(TASK)
            .map(Moments::of_serial)
            .reduce(|| Moments::EMPTY, Moments::merge)
    }

    /// Eight independent lanes of sums, so the additions pipeline and vectorize instead of
    /// waiting on one accumulator; blocks holding NaN/Inf take the scalar path. (`TASK`
    /// elements at most, so the u32 lane counters cannot overflow.)
    fn of_serial(xs: &[f32]) -> Moments {
        let mut m = Moments::EMPTY;
        let (mut sum, mut sq) = ([0f64; LANES], [0f64; LANES]);
        let (mut lo, mut hi) = ([f32::INFINITY; LANES], [f32::NEG_INFINITY; LANES]);
        let (mut zeros, mut big, mut blocks_finite) = ([0u32; LANES], [0u32; LANES], 0u64);
        let blocks = xs.chunks_exact(LANES);
        let tail = blocks.remainder();
        for block in blocks {
            if !block.iter().all(|x| x.is_finite()) {
                block.iter().for_each(|&x| m.add(x));
                continue;
            }
            blocks_finite += 1;
            for (i, &x) in block.iter().enumerate() {
                let v = f64::from(x);
                sum[i] += v;
                sq[i] += v * v;
                // Plain comparisons (the values are finite) compile to min/max instructions.
                lo[i] = if x < lo[i] { x } else { lo[i] };
                hi[i] = if x > hi[i] { x } else { hi[i] };
                zeros[i] += u32::from(x == 0.0);
                big[i] += u32::from(x.abs() > F16_MAX as f32);
            }
        }
        tail.iter().for_each(|&x| m.add(x));
        let n = blocks_finite * LANES as u64;
        m.count += n;
        m.finite += n;
        m.sum += sum.iter().sum::<f64>();
        m.sum_sq += sq.iter().sum::<f64>();
        m.zeros += zeros.iter().map(|&z| u64::from(z)).sum::<u64>();
        m.beyond_f16 += big.iter().map(|&z| u64::from(z)).sum::<u64>();
        if n > 0 {
            m.min = m
                .min
                .min(f64::from(lo.iter().fold(f32::INFINITY, |a, &b| a.min(b))));
            m.max = m.max.max(f64::from(
                hi.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
            ));
        }
        m
    }

    fn add(&mut self, x: f32) {
        if x.is_nan() {
            self.count += 1;
            self.nan += 1;
        } else if x.is_infinite() {
            self.count += 1;
            self.inf += 1;
        } else {
            self.add_finite(x);
        }
    }

    fn add_finite(&mut self, x: f32) {
        let v = f64::from(x);
        self.count += 1;
        self.finite += 1;
        self.zeros += u64::from(x == 0.0);
        self.beyond_f16 += u64::from(v.abs() > F16_MAX);
        self.sum += v;
        self.sum_sq += v * v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }

    fn merge(a: Moments, b: Moments) -> Moments {
        Moments {
            count: a.count + b.count,
            finite: a.finite + b.finite,
            nan: a.nan + b.nan,
            inf: a.inf + b.inf,
            zeros: a.zeros + b.zeros,
            beyond_f16: a.beyond_f16 + b.beyond_f16,
            sum: a.sum + b.sum,
            sum_sq: a.sum_sq + b.sum_sq,
            min: a.min.min(b.min),
            max: a.max.max(b.max),
        }
    }

    /// When even the extremes lie within [`OUTLIER_SIGMAS`], there are no outliers and the
    /// largest deviation is the extremes' — known without another pass over the values.
    fn outliers_known(&self) -> Option<(u64, f64)> {
        let (mean, std) = self.mean_std();
        if self.finite == 0 || std == 0.0 {
            return Some((0, 0.0));
        }
        let extreme = (self.min - mean).abs().max((self.max - mean).abs()) / std;
        (extreme <= OUTLIER_SIGMAS).then_some((0, extreme))
    }

    fn mean_std(&self) -> (f64, f64) {
        if self.finite == 0 {
            return (0.0, 0.0);
        }
        let n = self.finite as f64;
        let mean = self.sum / n;
        (mean, (self.sum_sq / n - mean * mean).max(0.0).sqrt())
    }
}

/// Outlier count and largest deviation of `xs` in units of `std` (NaN/Inf left out).
fn deviations(xs: &[f32], mean: f64, std: f64) -> (u64, f64) {
    if std == 0.0 {
        return (0, 0.0);
    }
    let inv = 1.0 / std;
    let one = |c: &[f32]| {
        let (mut count, mut worst) = ([0u64; LANES], [0f64; LANES]);
        let blocks = c.chunks_exact(LANES);
        let tail = blocks.remainder().iter().copied();
        let mut visit = |lane: usize, x: f32| {
            // NaN and Inf are not outliers: they are counted on their own.
            let z = if x.is_finite() {
                (f64::from(x) - mean).abs() * inv
            } else {
                0.0
            };
            count[lane] += u64::from(z > OUTLIER_SIGMAS);
            worst[lane] = if z > worst[lane] { z } else { worst[lane] };
        };
        for block in blocks {
            for (lane, &x) in block.iter().enumerate() {
                visit(lane, x);
            }
        }
        tail.for_each(|x| visit(0, x));
        (
            count.iter().sum::<u64>(),
            worst.iter().fold(0f64, |a, &b| a.max(b)),
        )
    };
    xs.par_chunks(TASK)
        .map(one)
        .reduce(|| (0, 0.0), |a, b| (a.0 + b.0, a.1.max(b.1)))
}

/// Dequantize `t` chunk by chunk and gather its health; a second pass finds outliers when the
/// tensor did not fit in one chunk (the first pass needs the mean and std first).
pub fn tensor_health(files: &ModelFiles, t: &TensorEntry) -> Result<Health> {
    let mut m = Moments::EMPTY;
    let single = files.chunk_count(t) <= 1;
    let mut one_pass = None;
    files.for_each_chunk(t, |xs| {
        m = Moments::merge(m, Moments::of(xs));
        if single {
            one_pass = Some(m.outliers_known().unwrap_or_else(|| {
                let (mean, std) = m.mean_std();
                deviations(xs, mean, std)
            }));
        }
        Ok::<_, WeightError>(())
    })?;
    let (mean, std) = m.mean_std();
    let (outliers, max_sigma) = match one_pass.or_else(|| m.outliers_known()) {
        Some(found) => found,
        None => {
            let mut acc = (0, 0.0f64);
            files.for_each_chunk(t, |xs| {
                let (n, z) = deviations(xs, mean, std);
                acc = (acc.0 + n, acc.1.max(z));
                Ok::<_, WeightError>(())
            })?;
            acc
        }
    };
    let (min, max) = if m.finite == 0 {
        (0.0, 0.0)
    } else {
        (m.min, m.max)
    };
    let absmax = min.abs().max(max.abs());
    Ok(Health {
        count: m.count,
        nan: m.nan,
        inf: m.inf,
        zeros: m.zeros,
        mean,
        std,
        min,
        max,
        absmax,
        beyond_f16: m.beyond_f16,
        f16_headroom: absmax / F16_MAX,
        bf16_headroom: absmax / BF16_MAX,
        outliers,
        max_sigma,
    })
}
