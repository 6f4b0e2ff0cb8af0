//! docs/design.md §6's per-stage metrics between a reference and a candidate tensor, in f64 over the
//! positions where both are finite (NaN and Inf are counted, not averaged).

use serde::{Deserialize, Serialize};

/// How a candidate tensor departs from the reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub cosine: f64,
    /// `1 − 2Σxy / Σ(x² + y²)`: 0 when equal, scale-aware (a 2× candidate is not "close").
    pub rel_diff: f64,
    /// `Σ(x − y)² / Σx²`.
    pub nmse: f64,
    /// `−10·log10(nmse)` dB (∞ when equal).
    pub sqnr_db: f64,
    pub max_abs: f64,
    /// Flat index of `max_abs`.
    pub max_abs_index: u64,
    pub mean_abs: f64,
    /// `‖cand‖ / ‖ref‖`.
    pub norm_ratio: f64,
    pub ref_nan: u64,
    pub ref_inf: u64,
    pub cand_nan: u64,
    pub cand_inf: u64,
    pub ref_absmax: f64,
    pub cand_absmax: f64,
}

impl Metrics {
    /// Panics when the lengths differ: callers check shapes first.
    pub fn of(reference: &[f32], candidate: &[f32]) -> Metrics {
        assert_eq!(
            reference.len(),
            candidate.len(),
            "compared tensors differ in size"
        );
        let mut m = Metrics {
            cosine: 0.0,
            rel_diff: 0.0,
            nmse: 0.0,
            sqnr_db: f64::INFINITY,
            max_abs: 0.0,
            max_abs_index: 0,
            mean_abs: 0.0,
            norm_ratio: 0.0,
            ref_nan: 0,
            ref_inf: 0,
            cand_nan: 0,
            cand_inf: 0,
            ref_absmax: 0.0,
            cand_absmax: 0.0,
        };
        let (mut xx, mut yy, mut xy, mut dd, mut abs_sum, mut n) =
            (0f64, 0f64, 0f64, 0f64, 0f64, 0u64);
        for (i, (&x, &y)) in reference.iter().zip(candidate).enumerate() {
            m.ref_nan += u64::from(x.is_nan());
            m.ref_inf += u64::from(x.is_infinite());
            m.cand_nan += u64::from(y.is_nan());
            m.cand_inf += u64::from(y.is_infinite());
            if !(x.is_finite() && y.is_finite()) {
                continue;
            }
            let (x, y) = (f64::from(x), f64::from(y));
            let d = (x - y).abs();
            if d > m.max_abs {
                m.max_abs = d;
                m.max_abs_index = i as u64;
            }
            m.ref_absmax = m.ref_absmax.max(x.abs());
            m.cand_absmax = m.cand_absmax.max(y.abs());
            xx += x * x;
            yy += y * y;
            xy += x * y;
            dd += d * d;
            abs_sum += d;
            n += 1;
        }
        m.mean_abs = if n > 0 { abs_sum / n as f64 } else { 0.0 };
        m.cosine = match (xx > 0.0, yy > 0.0) {
            // Equal tensors are exactly 1, whatever the rounding of the norms.
            _ if dd == 0.0 => 1.0,
            (true, true) => (xy / (xx.sqrt() * yy.sqrt())).clamp(-1.0, 1.0),
            (false, false) => 1.0,
            _ => 0.0,
        };
        m.rel_diff = if xx + yy > 0.0 {
            1.0 - 2.0 * xy / (xx + yy)
        } else {
            0.0
        };
        m.nmse = if xx > 0.0 {
            dd / xx
        } else if dd > 0.0 {
            f64::INFINITY
        } else {
            0.0
        };
        m.sqnr_db = if m.nmse > 0.0 {
            -10.0 * m.nmse.log10()
        } else {
            f64::INFINITY
        };
        m.norm_ratio = if xx > 0.0 {
            (yy / xx).sqrt()
        } else if yy > 0.0 {
            f64::INFINITY
        } else {
            1.0
        };
        m
    }

    /// NaN or Inf in the candidate where the reference has none.
    pub fn new_non_finite(&self) -> bool {
        self.cand_nan > self.ref_nan || self.cand_inf > self.ref_inf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_tensors_have_zero_error_and_scaled_ones_keep_cosine() {
        let x = [1.0f32, -2.0, 3.0, 0.5];
        let same = Metrics::of(&x, &x);
        assert_eq!((same.rel_diff, same.nmse, same.max_abs), (0.0, 0.0, 0.0));
        assert_eq!((same.cosine, same.norm_ratio), (1.0, 1.0));
        let twice: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
        let m = Metrics::of(&x, &twice);
        assert!((m.cosine - 1.0).abs() < 1e-12 && (m.norm_ratio - 2.0).abs() < 1e-12);
        assert!((m.rel_diff - 0.2).abs() < 1e-12, "1 − 4/5");
        assert_eq!((m.max_abs, m.max_abs_index), (3.0, 2));
    }

    #[test]
    fn non_finite_values_are_counted_not_averaged() {
        let m = Metrics::of(&[1.0, 2.0, 3.0], &[1.0, f32::NAN, f32::INFINITY]);
        assert_eq!((m.cand_nan, m.cand_inf, m.ref_nan), (1, 1, 0));
        assert!(m.new_non_finite());
        assert_eq!(m.max_abs, 0.0);
    }
}
