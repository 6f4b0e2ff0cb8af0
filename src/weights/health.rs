//! Weight health: the statistics that show a broken dequantization or a poisoned weight (NaN/Inf,
//! values past the fp16 or bf16 range, outliers), computed over row chunks so that memory stays
//! at one chunk whatever the tensor's size.

use serde::Serialize;

use super::{ModelFiles, Result, TensorEntry};

/// Largest finite f16.
pub const F16_MAX: f64 = 65504.0;
/// Largest finite bf16.
pub const BF16_MAX: f64 = 3.3895313892515355e38;
/// An element is an outlier when it lies this many standard deviations from the mean.
pub const OUTLIER_SIGMAS: f64 = 8.0;
/// Elements dequantized at a time (64 MiB of f32).
const CHUNK_ELEMS: u64 = 1 << 24;

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

/// Running sums over chunks.
#[derive(Default)]
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
    fn add(&mut self, xs: &[f32]) {
        if self.count == 0 {
            self.min = f64::INFINITY;
            self.max = f64::NEG_INFINITY;
        }
        self.count += xs.len() as u64;
        for &x in xs {
            if x.is_nan() {
                self.nan += 1;
            } else if x.is_infinite() {
                self.inf += 1;
            } else {
                let v = f64::from(x);
                self.finite += 1;
                self.zeros += u64::from(x == 0.0);
                self.beyond_f16 += u64::from(v.abs() > F16_MAX);
                self.sum += v;
                self.sum_sq += v * v;
                self.min = self.min.min(v);
                self.max = self.max.max(v);
            }
        }
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

/// Outlier count and largest deviation of `xs` in units of `std`.
fn deviations(xs: &[f32], mean: f64, std: f64) -> (u64, f64) {
    if std == 0.0 {
        return (0, 0.0);
    }
    xs.iter()
        .filter(|x| x.is_finite())
        .fold((0, 0.0f64), |(n, worst), &x| {
            let z = (f64::from(x) - mean).abs() / std;
            (n + u64::from(z > OUTLIER_SIGMAS), worst.max(z))
        })
}

/// Dequantize `t` chunk by chunk and gather its health; a second pass finds outliers when the
/// tensor did not fit in one chunk.
pub fn tensor_health(files: &ModelFiles, t: &TensorEntry) -> Result<Health> {
    let rows_per_chunk = (CHUNK_ELEMS / t.row_len().max(1)).max(1);
    let chunks: Vec<_> = (0..t.rows())
        .step_by(rows_per_chunk as usize)
        .map(|r| r..(r + rows_per_chunk).min(t.rows()))
        .collect();
    let mut m = Moments::default();
    let mut last = Vec::new();
    for rows in &chunks {
        last = files.dequantize_rows(t, rows.clone())?;
        m.add(&last);
    }
    let (mean, std) = m.mean_std();
    let (outliers, max_sigma) = if chunks.len() <= 1 {
        deviations(&last, mean, std)
    } else {
        let mut acc = (0, 0.0f64);
        for rows in &chunks {
            let (n, z) = deviations(&files.dequantize_rows(t, rows.clone())?, mean, std);
            acc = (acc.0 + n, acc.1.max(z));
        }
        acc
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
