//! What the plots share: value axes (linear or log, with their ticks), the plot width and
//! margins, colours written as SVG wants them, and polylines that break at missing points.

use std::fmt::Write;

/// The width of every plot, and its left and right margins.
pub(crate) const W: f64 = 960.0;
pub(crate) const LEFT: f64 = 78.0;
pub(crate) const RIGHT: f64 = 20.0;

/// New NaN/Inf and top-1 disagreements, in every plot.
pub(crate) const ALARM: &str = "#c1121f";

/// `#rrggbb`.
pub(crate) fn hex(c: [u8; 3]) -> String {
    format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2])
}

/// A value axis mapped onto `[top, top + height]` pixels (larger values up).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scale {
    Linear {
        lo: f64,
        hi: f64,
    },
    /// Decimal exponents.
    Log {
        lo: f64,
        hi: f64,
    },
}

impl Scale {
    /// A log axis over the positive finite values, in whole decades (at least two).
    pub(crate) fn log_of(values: impl Iterator<Item = f64>) -> Scale {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| v.is_finite() && *v > 0.0) {
            lo = lo.min(v.log10());
            hi = hi.max(v.log10());
        }
        if !lo.is_finite() {
            return Scale::Log { lo: -12.0, hi: 0.0 };
        }
        let (mut lo, mut hi) = (lo.floor().max(-30.0), hi.ceil().min(30.0));
        if hi - lo < 2.0 {
            lo = (lo - 1.0).max(-30.0);
            hi = lo + 2.0;
        }
        Scale::Log { lo, hi }
    }

    /// A linear axis over the finite values and `must` (padded by 8 %); a log axis when they
    /// are all positive and span more than 30×.
    pub(crate) fn linear_of(values: impl Iterator<Item = f64>, must: f64, min_span: f64) -> Scale {
        let finite: Vec<f64> = values.filter(|v| v.is_finite()).collect();
        let lo = finite.iter().copied().fold(must, f64::min);
        let hi = finite.iter().copied().fold(must, f64::max);
        if lo > 0.0 && hi / lo > 30.0 {
            return Scale::log_of(finite.into_iter().chain([must]));
        }
        let span = (hi - lo).max(min_span);
        let mid = (hi + lo) / 2.0;
        let (lo, hi) = if hi - lo < min_span {
            (mid - span / 2.0, mid + span / 2.0)
        } else {
            (lo, hi)
        };
        Scale::Linear {
            lo: lo - 0.08 * span,
            hi: hi + 0.08 * span,
        }
    }

    /// Pixel y of `v`; values at or below a log axis's floor sit on its bottom edge.
    pub(crate) fn y(&self, v: f64, top: f64, height: f64) -> Option<f64> {
        if v.is_nan() {
            return None;
        }
        let t = match *self {
            Scale::Linear { lo, hi } => (v - lo) / (hi - lo),
            Scale::Log { lo, hi } => {
                if v <= 0.0 {
                    0.0
                } else {
                    (v.log10() - lo) / (hi - lo)
                }
            }
        };
        if !t.is_finite() {
            return None;
        }
        Some(top + height * (1.0 - t.clamp(0.0, 1.0)))
    }

    /// A grid line and its label at every tick, across a plot of `width` from `left`, its
    /// values between `top` and `top + height`.
    pub(crate) fn gridlines(&self, h: &mut String, left: f64, width: f64, top: f64, height: f64) {
        for (v, label) in self.ticks() {
            if let Some(y) = self.y(v, top, height) {
                gridline(h, left, width, y, &label);
            }
        }
    }

    /// Tick values with their labels.
    pub(crate) fn ticks(&self) -> Vec<(f64, String)> {
        match *self {
            Scale::Log { lo, hi } => {
                let decades = (hi - lo) as i64;
                let step = ((decades + 6) / 7).max(1);
                (lo as i64..=hi as i64)
                    .filter(|e| (e - lo as i64) % step == 0)
                    .map(|e| (10f64.powi(e as i32), format!("1e{e}")))
                    .collect()
            }
            Scale::Linear { lo, hi } => {
                let step = nice_step((hi - lo) / 4.0);
                let digits = (-step.log10().floor()).max(0.0) as usize;
                let mut v = (lo / step).ceil() * step;
                let mut out = Vec::new();
                while v <= hi + step * 1e-9 && out.len() < 12 {
                    out.push((v, format!("{v:.digits$}")));
                    v += step;
                }
                out
            }
        }
    }

    pub(crate) fn is_log(&self) -> bool {
        matches!(self, Scale::Log { .. })
    }
}

/// One horizontal grid line at pixel `y` with its label left of the plot.
pub(crate) fn gridline(h: &mut String, left: f64, width: f64, y: f64, label: &str) {
    let _ = write!(
        h,
        "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#e3e7ee\"/>\
         <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{label}</text>",
        left + width,
        left - 6.0,
        y + 4.0
    );
}

/// 1, 2 or 5 times a power of ten, near `raw`.
pub(crate) fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let p = 10f64.powf(raw.log10().floor());
    let f = raw / p;
    p * if f < 1.5 {
        1.0
    } else if f < 3.5 {
        2.0
    } else if f < 7.5 {
        5.0
    } else {
        10.0
    }
}

/// Lines through consecutive points; a missing point breaks the line.
pub(crate) fn polyline(
    h: &mut String,
    pts: &[Option<(f64, f64, String)>],
    stroke: &str,
    width: f64,
    dash: Option<&str>,
) {
    let dash = dash
        .map(|d| format!(" stroke-dasharray=\"{d}\""))
        .unwrap_or_default();
    for run in pts.split(|p| p.is_none()) {
        if run.len() < 2 {
            continue;
        }
        let coords: Vec<String> = run
            .iter()
            .flatten()
            .map(|(x, y, _)| format!("{x:.1},{y:.1}"))
            .collect();
        let _ = write!(
            h,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{stroke}\" stroke-width=\"{width}\" \
             stroke-linejoin=\"round\"{dash}/>",
            coords.join(" ")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::html::{PLOT_BACKGROUND, PRIMARY_STROKE};

    #[test]
    fn colours_are_written_as_the_constants_say() {
        assert_eq!(hex(PRIMARY_STROKE), "#e4007c");
        assert_eq!(hex(PLOT_BACKGROUND), "#fbfaf2");
    }

    #[test]
    fn axes_cover_their_values() {
        let Scale::Log { lo, hi } = Scale::log_of([3e-9, 0.02, 0.0].into_iter()) else {
            panic!("log axis")
        };
        assert_eq!((lo, hi), (-9.0, -1.0));
        let s = Scale::log_of([1e-7].into_iter());
        assert!(s.y(1e-7, 0.0, 100.0).is_some());
        assert_eq!(
            s.y(0.0, 0.0, 100.0),
            Some(100.0),
            "0 sits on the bottom edge"
        );
        let lin = Scale::linear_of([0.999999, 1.0].into_iter(), 1.0, 1e-6);
        assert!(lin.y(0.999999, 0.0, 100.0).unwrap() > lin.y(1.0, 0.0, 100.0).unwrap());
        assert!(!lin.ticks().is_empty());
        assert!(Scale::linear_of([0.01, 5.0].into_iter(), 1.0, 1e-5).is_log());
        assert_eq!(nice_step(0.3), 0.2);
        assert_eq!(nice_step(7.0), 5.0);
    }
}
