//! The comparison as one self-contained HTML file: no network, no JavaScript, only inline CSS
//! and SVG. A verdict banner, the fault with its evidence, the per-layer divergence plot
//! (`rel_diff` on a log axis, cosine and norm ratio, one series per stage kind, the first
//! divergence marked), the logits (health, a histogram of the last position's logits and the
//! entropy per position, reference against candidate) and the stage tables.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::{
    basis_word, headline, is_first, layer_rows, log_level, notable_stages, num, stage_label,
    LogitsSide, LogitsView,
};
use crate::compare::diff::Basis;
use crate::compare::{DiffReport, StageDiff, Status};
use crate::model::stage::kind_of;

/// The `id` of the divergence plot's `<svg>`.
pub const PLOT_ID: &str = "divergence-plot";
/// The `id` of the logits histogram's `<svg>`.
pub const HISTOGRAM_ID: &str = "logits-histogram";
/// The fill of the divergence plot's panels, and nowhere else on the page.
pub const PLOT_BACKGROUND: [u8; 3] = [0xfb, 0xfa, 0xf2];
/// The stroke and marker colour of the plot's first series (`L*.out` when the traces hold it),
/// and nowhere else on the page but the legend.
pub const PRIMARY_STROKE: [u8; 3] = [0xe4, 0x00, 0x7c];
/// The band behind the first divergent column in every panel.
pub const DIVERGENCE_BAND: [u8; 3] = [0xff, 0xcf, 0xd6];

/// Series colours after [`PRIMARY_STROKE`].
const PALETTE: [&str; 5] = ["#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
const WORST_STROKE: &str = "#a0a4ab";
const TOLERANCE_STROKE: &str = "#444b55";
const ALARM: &str = "#c1121f";
const REF_FILL: &str = "#9ecae1";
const REF_STROKE: &str = "#3182bd";
const CAND_STROKE: &str = "#ff7f0e";

/// Stage kinds drawn as series, in this order, when the traces hold them.
const PREFERRED_KINDS: [&str; 4] = ["out", "attn.out", "ffn.out", "moe.routed"];

fn hex(c: [u8; 3]) -> String {
    format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2])
}

/// Text for HTML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() && c != '\n' && c != '\t' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

const CSS: &str = r#"
:root { color-scheme: light; }
body { margin: 0; background: #fff; color: #1d2330;
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", sans-serif; }
main { max-width: 1000px; margin: 0 auto; padding: 0 16px 48px; }
h2 { font-size: 18px; margin: 28px 0 8px; }
.banner { padding: 16px 24px; color: #fff; }
.banner.fail { background: #b3261e; }
.banner.pass { background: #1e7f3c; }
.banner h1 { margin: 0; font-size: 26px; letter-spacing: .02em; }
.banner p { margin: 4px 0 0; }
.banner code { background: rgba(255,255,255,.18); color: #fff; }
.banner a { color: #fff; }
.fault { border-left: 6px solid #b3261e; background: #fff4f2; padding: 10px 16px; margin: 18px 0; }
.fault.mild { border-color: #b7791f; background: #fff9e8; }
.fault.none { border-color: #1e7f3c; background: #effaf2; }
.fault h2 { margin: 0 0 4px; font-size: 16px; }
.fault ul { margin: 6px 0 0; padding-left: 20px; }
code { font: 12.5px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  background: #eef1f5; padding: 1px 4px; border-radius: 3px; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e3e6eb; text-align: right; white-space: nowrap; }
th { background: #f4f6f8; font-weight: 600; }
th.l, td.l { text-align: left; }
tr.fail td { background: #fdecea; }
tr.first td { background: #f7c2bb; font-weight: 600; }
.scroll { overflow-x: auto; }
.bar { display: inline-block; height: 9px; background: #bfc6cf; vertical-align: middle; }
.bar.fail { background: #d9534f; }
figure { margin: 16px 0; }
figcaption { color: #555; font-size: 12.5px; margin-top: 4px; }
svg { max-width: 100%; height: auto; display: block; }
svg text { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; fill: #333; }
.muted { color: #666; }
details summary { cursor: pointer; font-weight: 600; margin: 10px 0; }
footer { color: #777; font-size: 12px; margin-top: 32px; }
"#;

/// The report as one HTML document.
pub fn html(report: &DiffReport, logits: Option<&LogitsView>) -> String {
    let mut h = String::with_capacity(64 * 1024);
    let verdict = headline(report);
    let class = match report.verdict {
        Status::Pass => "pass",
        Status::Fail => "fail",
    };
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>glmcheck diff: {verdict} — {}</title>\n<style>{CSS}</style>\n</head>\n<body>\n",
        esc(&report.candidate)
    );

    // Banner.
    let _ = write!(
        h,
        "<header class=\"banner {class}\" id=\"verdict\"><h1>{verdict}</h1>\
         <p><code>{}</code> against <code>{}</code> · candidate dtype <code>{}</code> · \
         tolerance: {}</p><p>",
        esc(&report.candidate),
        esc(&report.reference),
        esc(&report.candidate_dtype),
        esc(&report.tolerance_source),
    );
    match &report.first_divergence {
        Some(d) => {
            let _ = write!(
                h,
                "First divergence: <a href=\"#first-divergence\"><code>{}</code></a>",
                esc(&d.stage)
            );
            if let Some(l) = d.layer {
                let _ = write!(h, " (layer {l})");
            }
            if let Some(r) = d.rank {
                let _ = write!(h, " rank {r}");
            }
            h.push_str(" · ");
        }
        None => h.push_str("No stage departs beyond its tolerance · "),
    }
    let _ = write!(
        h,
        "a tolerance of <code>{}</code> would pass every value stage · {} stages compared</p>\
         </header>\n<main>\n",
        num(report.tolerance_to_pass),
        report.stages.len()
    );

    fault_box(&mut h, report);

    h.push_str("<h2>Divergence per layer</h2>\n<figure>\n");
    divergence_plot(&mut h, report);
    h.push_str(
        "<figcaption>Per layer, one line per stage kind. Top: rel_diff = 1 − 2Σxy/Σ(x²+y²) on a \
         log axis (0 is drawn on the bottom edge; hollow markers are lower bounds from \
         statistics); middle: cosine; bottom: norm ratio ‖cand‖/‖ref‖. The grey line follows the \
         most departed stage of each layer; the red band marks the first divergence; red \
         triangles mark new NaN/Inf. Hover a marker for its stage and value.</figcaption>\n\
         </figure>\n",
    );

    if let Some(view) = logits {
        logits_section(&mut h, view);
    }

    per_layer_table(&mut h, report);
    notable_table(&mut h, report);
    h.push_str("<details><summary>Every stage</summary>\n");
    stage_table(&mut h, report, 0..report.stages.len(), false);
    h.push_str("</details>\n");
    let _ = write!(
        h,
        "<footer>glmcheck {} · <code>glmcheck diff</code> report; self-contained, no scripts, no \
         network.</footer>\n</main>\n</body>\n</html>\n",
        env!("CARGO_PKG_VERSION")
    );
    h
}

fn fault_box(h: &mut String, report: &DiffReport) {
    let Some(f) = &report.fault else {
        h.push_str(
            "<section class=\"fault none\" id=\"fault\"><h2>No fault</h2>\
             <p>Every stage is within its tolerance.</p></section>\n",
        );
        return;
    };
    let mild = match report.verdict {
        Status::Pass => " mild",
        Status::Fail => "",
    };
    let _ = write!(
        h,
        "<section class=\"fault{mild}\" id=\"fault\"><h2>Fault: <code>{}</code></h2><p>{}</p>",
        esc(f.class.name()),
        esc(&f.summary)
    );
    if let Some(w) = &f.weight {
        let _ = write!(h, "<p>Weight: <code>{}</code></p>", esc(w));
    }
    if !f.evidence.is_empty() {
        h.push_str("<ul>");
        for e in &f.evidence {
            let _ = write!(h, "<li>{}</li>", esc(e));
        }
        h.push_str("</ul>");
    }
    h.push_str("</section>\n");
}

// ---------------------------------------------------------------------------------------------
// Axes

/// A value axis mapped onto `[top, top + height]` pixels (larger values up).
#[derive(Clone, Copy, Debug)]
enum Scale {
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
    fn log_of(values: impl Iterator<Item = f64>) -> Scale {
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
    fn linear_of(values: impl Iterator<Item = f64>, must: f64, min_span: f64) -> Scale {
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
    fn y(&self, v: f64, top: f64, height: f64) -> Option<f64> {
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

    /// Tick values with their labels.
    fn ticks(&self) -> Vec<(f64, String)> {
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

    fn is_log(&self) -> bool {
        matches!(self, Scale::Log { .. })
    }
}

/// 1, 2 or 5 times a power of ten, near `raw`.
fn nice_step(raw: f64) -> f64 {
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

// ---------------------------------------------------------------------------------------------
// The divergence plot

const W: f64 = 960.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 20.0;

/// One x position: a layer, or a stage outside the layers (`embed`, `final_norm`, `logits`).
struct Column<'r> {
    label: String,
    layer: Option<u64>,
    /// The first record of each stage name (the whole tensor where there is one).
    stages: Vec<&'r StageDiff>,
}

impl Column<'_> {
    fn of_kind(&self, kind: &str) -> Option<&StageDiff> {
        self.stages
            .iter()
            .copied()
            .find(|s| s.basis != Basis::Ids && kind_of(&s.stage) == Some(kind))
    }

    fn judged(&self) -> impl Iterator<Item = &StageDiff> {
        self.stages
            .iter()
            .copied()
            .filter(|s| s.basis != Basis::Ids)
    }

    /// A stage whose tolerance stands for the column (its `out`, else its tightest).
    fn tolerance(&self) -> Option<f64> {
        self.of_kind("out")
            .map(|s| s.tolerance)
            .or_else(|| self.judged().map(|s| s.tolerance).reduce(f64::min))
    }

    fn new_non_finite(&self) -> Option<&StageDiff> {
        self.stages
            .iter()
            .copied()
            .find(|s| s.candidate.non_finite() > s.reference.non_finite())
    }
}

fn columns(report: &DiffReport) -> Vec<Column<'_>> {
    let mut seen = std::collections::HashSet::new();
    let (mut pre, mut post) = (Vec::new(), Vec::new());
    let mut layers: BTreeMap<u64, Vec<&StageDiff>> = BTreeMap::new();
    for s in &report.stages {
        if !seen.insert(s.stage.as_str()) {
            continue;
        }
        match s.layer {
            Some(l) => layers.entry(l).or_default().push(s),
            None => {
                let c = Column {
                    label: s.stage.clone(),
                    layer: None,
                    stages: vec![s],
                };
                if layers.is_empty() {
                    pre.push(c)
                } else {
                    post.push(c)
                }
            }
        }
    }
    pre.into_iter()
        .chain(layers.into_iter().map(|(l, stages)| Column {
            label: l.to_string(),
            layer: Some(l),
            stages,
        }))
        .chain(post)
        .collect()
}

/// The stage kinds drawn as series.
fn series_kinds(report: &DiffReport, cols: &[Column]) -> Vec<String> {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for c in cols.iter().filter(|c| c.layer.is_some()) {
        for s in c.judged() {
            if let Some(k) = kind_of(&s.stage) {
                *counts.entry(k).or_default() += 1;
            }
        }
    }
    let mut kinds: Vec<String> = PREFERRED_KINDS
        .iter()
        .filter(|k| counts.contains_key(*k))
        .map(|k| k.to_string())
        .collect();
    if kinds.is_empty() {
        let mut by_count: Vec<(&str, usize)> = counts.iter().map(|(k, n)| (*k, *n)).collect();
        by_count.sort_by_key(|&(_, n)| std::cmp::Reverse(n));
        kinds = by_count
            .into_iter()
            .take(4)
            .map(|(k, _)| k.to_string())
            .collect();
    }
    if let Some(k) = report
        .first_divergence
        .as_ref()
        .and_then(|d| kind_of(&d.stage))
    {
        if counts.contains_key(k) && !kinds.iter().any(|x| x == k) {
            kinds.push(k.to_string());
        }
    }
    kinds
}

/// One panel of the plot.
struct Panel {
    top: f64,
    height: f64,
    scale: Scale,
    title: &'static str,
    /// A dashed reference line (cosine 1, norm ratio 1).
    guide: Option<f64>,
}

/// Which value a panel shows.
#[derive(Clone, Copy)]
enum Quantity {
    RelDiff,
    Cosine,
    NormRatio,
}

impl Quantity {
    fn of(self, s: &StageDiff) -> Option<f64> {
        if s.basis == Basis::Ids {
            return None;
        }
        match self {
            Quantity::RelDiff => Some(s.rel_diff),
            Quantity::Cosine => s.metrics.as_ref().map(|m| m.cosine),
            Quantity::NormRatio => s.metrics.as_ref().map(|m| m.norm_ratio),
        }
        .filter(|v| v.is_finite())
    }

    /// The most departed value of a column: largest rel_diff, smallest cosine, norm ratio
    /// farthest from 1.
    fn worst(self, c: &Column) -> Option<(f64, String)> {
        let vals = c.judged().filter_map(|s| self.of(s).map(|v| (v, &s.stage)));
        let best = match self {
            Quantity::RelDiff => vals.max_by(|a, b| a.0.total_cmp(&b.0)),
            Quantity::Cosine => vals.min_by(|a, b| a.0.total_cmp(&b.0)),
            Quantity::NormRatio => vals
                .filter(|(v, _)| *v > 0.0)
                .max_by(|a, b| a.0.ln().abs().total_cmp(&b.0.ln().abs())),
        };
        best.map(|(v, s)| (v, s.clone()))
    }

    fn name(self) -> &'static str {
        match self {
            Quantity::RelDiff => "rel_diff",
            Quantity::Cosine => "cosine",
            Quantity::NormRatio => "norm ratio",
        }
    }
}

/// A value for a tooltip.
fn tip_num(v: f64) -> String {
    if v != 0.0 && (1e-3..1e5).contains(&v.abs()) && (v - 1.0).abs() < 1e-3 {
        format!("{v:.9}")
    } else {
        num(v)
    }
}

fn divergence_plot(h: &mut String, report: &DiffReport) {
    let cols = columns(report);
    let kinds = series_kinds(report, &cols);
    let n = cols.len().max(1);
    let plot_w = W - LEFT - RIGHT;
    let colw = plot_w / n as f64;
    let cx = |i: usize| LEFT + (i as f64 + 0.5) * colw;

    // Legend entries: (swatch kind, colour, label).
    let colour = |i: usize| {
        if i == 0 {
            hex(PRIMARY_STROKE)
        } else {
            PALETTE[(i - 1) % PALETTE.len()].to_string()
        }
    };
    let mut legend: Vec<(&str, String, String)> = kinds
        .iter()
        .enumerate()
        .map(|(i, k)| ("line", colour(i), format!("L*.{k}")))
        .collect();
    legend.push((
        "dash",
        WORST_STROKE.into(),
        "most departed stage of the layer".into(),
    ));
    legend.push(("dash", TOLERANCE_STROKE.into(), "tolerance".into()));
    if report.first_divergence.is_some() {
        legend.push(("band", hex(DIVERGENCE_BAND), "first divergence".into()));
    }
    // Lay the legend out in rows.
    let mut legend_rows: Vec<Vec<(f64, usize)>> = vec![vec![]];
    let mut x = LEFT;
    for (i, (_, _, label)) in legend.iter().enumerate() {
        let w = 34.0 + 6.6 * label.chars().count() as f64 + 18.0;
        if x + w > W - RIGHT && !legend_rows.last().unwrap().is_empty() {
            legend_rows.push(vec![]);
            x = LEFT;
        }
        legend_rows.last_mut().unwrap().push((x, i));
        x += w;
    }
    let legend_h = 20.0 * legend_rows.len() as f64 + 8.0;

    let rel_scale = Scale::log_of(
        cols.iter()
            .flat_map(|c| c.judged().map(|s| s.rel_diff))
            .chain(cols.iter().filter_map(|c| c.tolerance())),
    );
    let cos_scale = Scale::linear_of(
        cols.iter()
            .flat_map(|c| c.judged().filter_map(|s| Quantity::Cosine.of(s))),
        1.0,
        1e-6,
    );
    let norm_scale = Scale::linear_of(
        cols.iter()
            .flat_map(|c| c.judged().filter_map(|s| Quantity::NormRatio.of(s))),
        1.0,
        1e-5,
    );
    let top0 = legend_h + 26.0;
    let panels = [
        (
            Quantity::RelDiff,
            Panel {
                top: top0,
                height: 270.0,
                scale: rel_scale,
                title: "rel_diff (log)",
                guide: None,
            },
        ),
        (
            Quantity::Cosine,
            Panel {
                top: top0 + 270.0 + 34.0,
                height: 130.0,
                scale: cos_scale,
                title: "cosine",
                guide: Some(1.0),
            },
        ),
        (
            Quantity::NormRatio,
            Panel {
                top: top0 + 270.0 + 34.0 + 130.0 + 34.0,
                height: 130.0,
                scale: norm_scale,
                title: if norm_scale.is_log() {
                    "norm ratio (log)"
                } else {
                    "norm ratio"
                },
                guide: Some(1.0),
            },
        ),
    ];
    let bottom = panels[2].1.top + panels[2].1.height;
    let total_h = bottom + 74.0;

    let _ = writeln!(
        h,
        "<svg id=\"{PLOT_ID}\" width=\"{W}\" height=\"{total_h:.0}\" viewBox=\"0 0 {W} \
         {total_h:.0}\" role=\"img\" aria-labelledby=\"{PLOT_ID}-title\">\
         <title id=\"{PLOT_ID}-title\">Per-layer divergence: rel_diff, cosine and norm ratio of \
         each stage kind</title>"
    );
    // Legend.
    for (row, items) in legend_rows.iter().enumerate() {
        let y = 14.0 + 20.0 * row as f64;
        for &(x, i) in items {
            let (kind, c, label) = &legend[i];
            match *kind {
                "band" => {
                    let _ = write!(
                        h,
                        "<rect x=\"{x:.1}\" y=\"{:.1}\" width=\"26\" height=\"12\" fill=\"{c}\"/>",
                        y - 6.0
                    );
                }
                "dash" => {
                    let _ = write!(
                        h,
                        "<line x1=\"{x:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" \
                         stroke=\"{c}\" stroke-width=\"2\" stroke-dasharray=\"5 3\"/>",
                        x + 26.0
                    );
                }
                _ => {
                    let _ = write!(
                        h,
                        "<line x1=\"{x:.1}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" \
                         stroke=\"{c}\" stroke-width=\"2.5\"/><circle cx=\"{:.1}\" cy=\"{y:.1}\" \
                         r=\"3.2\" fill=\"{c}\"/>",
                        x + 26.0,
                        x + 13.0
                    );
                }
            }
            let _ = write!(
                h,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">{}</text>",
                x + 32.0,
                y + 4.0,
                esc(label)
            );
        }
    }
    h.push('\n');

    let first_col = report.first_divergence.as_ref().and_then(|d| {
        cols.iter().position(|c| match d.layer {
            Some(l) => c.layer == Some(l),
            None => c.label == d.stage,
        })
    });

    for (q, p) in &panels {
        // Background, band, grid, axes.
        let _ = write!(
            h,
            "<g class=\"panel\" data-quantity=\"{}\">\
             <rect x=\"{LEFT}\" y=\"{:.1}\" width=\"{plot_w:.1}\" height=\"{:.1}\" fill=\"{}\"/>",
            q.name(),
            p.top,
            p.height,
            hex(PLOT_BACKGROUND)
        );
        if let Some(i) = first_col {
            let bw = colw.max(8.0);
            let _ = write!(
                h,
                "<rect class=\"first-divergence\" x=\"{:.1}\" y=\"{:.1}\" width=\"{bw:.1}\" \
                 height=\"{:.1}\" fill=\"{}\"/>",
                (cx(i) - bw / 2.0).max(LEFT),
                p.top,
                p.height,
                hex(DIVERGENCE_BAND)
            );
        }
        for (v, label) in p.scale.ticks() {
            if let Some(y) = p.scale.y(v, p.top, p.height) {
                let _ = write!(
                    h,
                    "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" \
                     stroke=\"#e2e2da\" stroke-width=\"1\"/><text x=\"{:.1}\" y=\"{:.1}\" \
                     font-size=\"11\" text-anchor=\"end\">{label}</text>",
                    W - RIGHT,
                    LEFT - 6.0,
                    y + 4.0
                );
            }
        }
        if let Some(g) = p.guide {
            if let Some(y) = p.scale.y(g, p.top, p.height) {
                let _ = write!(
                    h,
                    "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" \
                     stroke=\"#8a8f98\" stroke-width=\"1\" stroke-dasharray=\"2 3\"/>",
                    W - RIGHT
                );
            }
        }
        let _ = writeln!(
            h,
            "<rect x=\"{LEFT}\" y=\"{:.1}\" width=\"{plot_w:.1}\" height=\"{:.1}\" fill=\"none\" \
             stroke=\"#9aa0a8\" stroke-width=\"1\"/><text x=\"{LEFT}\" y=\"{:.1}\" \
             font-size=\"12.5\" font-weight=\"600\">{}</text>",
            p.top,
            p.height,
            p.top - 7.0,
            p.title
        );

        // The most departed stage of each column, then the tolerance (rel_diff only).
        let worst: Vec<Option<(f64, f64, String)>> = cols
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (v, stage) = q.worst(c)?;
                let y = p.scale.y(v, p.top, p.height)?;
                Some((cx(i), y, format!("{stage}: {} {}", q.name(), tip_num(v))))
            })
            .collect();
        polyline(h, &worst, WORST_STROKE, 1.6, Some("5 3"));
        for (x, y, tip) in worst.iter().flatten() {
            let _ = write!(
                h,
                "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2.4\" fill=\"{WORST_STROKE}\">\
                 <title>most departed: {}</title></circle>",
                esc(tip)
            );
        }
        if matches!(q, Quantity::RelDiff) {
            let tol: Vec<Option<(f64, f64, String)>> = cols
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let t = c.tolerance()?;
                    Some((cx(i), p.scale.y(t, p.top, p.height)?, String::new()))
                })
                .collect();
            polyline(h, &tol, TOLERANCE_STROKE, 1.3, Some("6 4"));
        }

        // One series per stage kind, over the layers; the first drawn last, on top.
        for (k, kind) in kinds.iter().enumerate().rev() {
            let c = colour(k);
            let pts: Vec<Option<(f64, f64, String)>> = cols
                .iter()
                .enumerate()
                .map(|(i, col)| {
                    let s = col.of_kind(kind)?;
                    let v = q.of(s)?;
                    let y = p.scale.y(v, p.top, p.height)?;
                    let status = match s.status {
                        Status::Pass => "ok",
                        Status::Fail => "FAIL",
                    };
                    Some((
                        cx(i),
                        y,
                        format!("{}: {} {} ({status})", s.stage, q.name(), tip_num(v)),
                    ))
                })
                .collect();
            let _ = write!(h, "<g class=\"series\" data-kind=\"{}\">", esc(kind));
            polyline(h, &pts, &c, 2.2, None);
            for (i, pt) in pts.iter().enumerate() {
                let Some((x, y, tip)) = pt else { continue };
                let hollow = cols[i]
                    .of_kind(kind)
                    .is_some_and(|s| s.basis == Basis::Stats);
                let fill = if hollow { "#ffffff" } else { c.as_str() };
                let _ = write!(
                    h,
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"3.4\" fill=\"{fill}\" stroke=\"{c}\" \
                     stroke-width=\"1.4\"><title>{}</title></circle>",
                    esc(tip)
                );
            }
            h.push_str("</g>\n");
        }

        // New NaN/Inf: a red triangle on the top edge of the rel_diff panel.
        if matches!(q, Quantity::RelDiff) {
            for (i, c) in cols.iter().enumerate() {
                if let Some(s) = c.new_non_finite() {
                    let (x, y) = (cx(i), p.top + 1.0);
                    let _ = write!(
                        h,
                        "<path d=\"M{:.1} {y:.1} L{:.1} {y:.1} L{x:.1} {:.1} Z\" fill=\"{ALARM}\">\
                         <title>{}: {} NaN/Inf in the candidate, {} in the reference</title></path>",
                        x - 6.0,
                        x + 6.0,
                        y + 10.0,
                        esc(&s.stage),
                        s.candidate.non_finite(),
                        s.reference.non_finite()
                    );
                }
            }
            if let (Some(i), Some(d)) = (first_col, &report.first_divergence) {
                let x = cx(i);
                let anchor = if x > W - 260.0 { "end" } else { "start" };
                let tx = if anchor == "end" { x - 8.0 } else { x + 8.0 };
                let _ = write!(
                    h,
                    "<text x=\"{tx:.1}\" y=\"{:.1}\" font-size=\"12\" font-weight=\"600\" \
                     text-anchor=\"{anchor}\" stroke=\"#ffffff\" stroke-width=\"4\" \
                     paint-order=\"stroke\" style=\"fill:{ALARM}\">first \
                     divergence: {}</text>",
                    p.top + 24.0,
                    esc(&d.stage)
                );
            }
        }
        h.push_str("</g>\n");
    }

    // The x axis: layer numbers (thinned), then names of the stages outside the layers.
    let n_layers = cols.iter().filter(|c| c.layer.is_some()).count();
    let every = nice_step((n_layers as f64 / 24.0).max(1.0)).max(1.0) as u64;
    for (i, c) in cols.iter().enumerate() {
        let x = cx(i);
        match c.layer {
            Some(l) => {
                if l % every == 0 {
                    let _ = write!(
                        h,
                        "<line x1=\"{x:.1}\" y1=\"{bottom:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" \
                         stroke=\"#9aa0a8\"/><text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" \
                         text-anchor=\"middle\">{l}</text>",
                        bottom + 4.0,
                        bottom + 16.0
                    );
                }
            }
            None => {
                let _ = write!(
                    h,
                    "<text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\" \
                     transform=\"rotate(-35 {x:.1} {:.1})\">{}</text>",
                    bottom + 14.0,
                    bottom + 14.0,
                    esc(&c.label)
                );
            }
        }
    }
    let _ = writeln!(
        h,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">layer</text>\
         </svg>",
        LEFT + plot_w / 2.0,
        bottom + 52.0
    );
}

/// Lines through consecutive points; a missing point breaks the line.
fn polyline(
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

// ---------------------------------------------------------------------------------------------
// Logits

/// The entropy (nats) of one position's softmax; NaN when the row has no finite maximum.
fn entropy(row: &[f32]) -> f64 {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return f64::NAN;
    }
    let exp: Vec<f64> = row
        .iter()
        .map(|&v| (f64::from(v) - f64::from(max)).exp())
        .collect();
    let sum: f64 = exp.iter().sum();
    -exp.iter()
        .map(|e| e / sum)
        .filter(|&p| p > 0.0)
        .map(|p| p * p.ln())
        .sum::<f64>()
}

fn logits_section(h: &mut String, view: &LogitsView) {
    h.push_str("<h2>Logits</h2>\n");
    let sides = [
        ("reference", &view.reference),
        ("candidate", &view.candidate),
    ];
    h.push_str("<div class=\"scroll\"><table id=\"logits-health\"><tr><th class=\"l\"></th>");
    for (name, side) in &sides {
        if side.is_some() {
            let _ = write!(h, "<th>{name}</th>");
        }
    }
    h.push_str("</tr>");
    type Row = (&'static str, fn(&LogitsSide) -> String);
    let rows: [Row; 11] = [
        ("positions × vocab", |s| {
            format!("{} × {}", s.positions, s.vocab)
        }),
        ("entropy mean (ln V)", |s| {
            format!(
                "{:.4} ({:.4}; {:.1} %)",
                s.health.entropy_mean,
                s.health.ln_vocab,
                100.0 * s.health.entropy_mean / s.health.ln_vocab.max(f64::MIN_POSITIVE)
            )
        }),
        ("entropy max", |s| format!("{:.4}", s.health.entropy_max)),
        ("top-1 probability mean", |s| {
            format!("{:.4}", s.health.top1_prob_mean)
        }),
        ("top-1 margin mean", |s| num(s.health.margin_mean)),
        ("logit std mean", |s| num(s.health.logit_std_mean)),
        ("NaN", |s| s.health.nan.to_string()),
        ("Inf", |s| s.health.inf.to_string()),
        ("longest run of one top-1", |s| {
            s.health.longest_repeat.to_string()
        }),
        ("flat (entropy ≥ 90 % of ln V)", |s| {
            if s.health.flat { "yes" } else { "no" }.into()
        }),
        ("top-1 of the last position", |s| {
            s.health
                .top1
                .last()
                .map_or("-".into(), |t| format!("token {t}"))
        }),
    ];
    for (label, f) in rows {
        let _ = write!(h, "<tr><td class=\"l\">{label}</td>");
        for (_, side) in &sides {
            if let Some(s) = side {
                let _ = write!(h, "<td>{}</td>", esc(&f(s)));
            }
        }
        h.push_str("</tr>");
    }
    h.push_str("</table></div>\n");
    if let Some(c) = &view.comparison {
        let _ = writeln!(
            h,
            "<table id=\"logits-comparison\"><tr><th class=\"l\">candidate against reference\
             </th><th></th></tr>\
             <tr><td class=\"l\">KL(ref ‖ cand) mean / p99 / max</td><td>{} / {} / {}</td></tr>\
             <tr><td class=\"l\">top-1 agreement</td><td>{:.1} %</td></tr>\
             <tr><td class=\"l\">Δp of the reference's top-1: mean / min</td><td>{} / {}</td></tr>\
             </table>",
            num(c.kl_mean),
            num(c.kl_p99),
            num(c.kl_max),
            100.0 * c.top1_agreement,
            num(c.delta_p_mean),
            num(c.delta_p_min),
        );
    }
    h.push_str("<figure>\n");
    histogram(h, view);
    h.push_str(
        "<figcaption>Histogram of the logit values at the last position (the one that picks the \
         next token): reference as filled bars, candidate as an orange outline, counts on a log \
         axis; triangles mark each side's top-1 logit. NaN and Inf are left out and counted in \
         the table above.</figcaption>\n</figure>\n<figure>\n",
    );
    entropy_plot(h, view);
    h.push_str(
        "<figcaption>Entropy of the next-token distribution at each position; the dashed line is \
         ln V, a uniform distribution: output near it is noise. Red crosses mark positions whose \
         top-1 token differs.</figcaption>\n</figure>\n",
    );
}

fn histogram(h: &mut String, view: &LogitsView) {
    const BINS: usize = 48;
    let (w, ht, left, right, top, bottom) = (W, 260.0, LEFT, RIGHT, 30.0, 40.0);
    let rows: Vec<(&str, &LogitsSide)> = [
        ("reference", &view.reference),
        ("candidate", &view.candidate),
    ]
    .into_iter()
    .filter_map(|(n, s)| s.as_ref().map(|s| (n, s)))
    .collect();
    let last: Vec<(&str, &[f32], &LogitsSide)> = rows
        .iter()
        .map(|(n, s)| (*n, s.row(s.positions - 1), *s))
        .collect();
    let finite = || {
        last.iter()
            .flat_map(|(_, r, _)| r.iter().copied())
            .filter(|v| v.is_finite())
    };
    let lo = finite().fold(f32::INFINITY, f32::min);
    let hi = finite().fold(f32::NEG_INFINITY, f32::max);
    let _ = write!(
        h,
        "<svg id=\"{HISTOGRAM_ID}\" width=\"{w}\" height=\"{ht}\" viewBox=\"0 0 {w} {ht}\" \
         role=\"img\" aria-labelledby=\"{HISTOGRAM_ID}-title\"><title id=\"{HISTOGRAM_ID}-title\">\
         Histogram of the last position's logits, reference and candidate</title>"
    );
    let (pw, ph) = (w - left - right, ht - top - bottom);
    let _ = write!(
        h,
        "<rect x=\"{left}\" y=\"{top}\" width=\"{pw}\" height=\"{ph}\" fill=\"#f7f9fc\" \
         stroke=\"#9aa0a8\"/><text x=\"{left}\" y=\"{:.1}\" font-size=\"12.5\" \
         font-weight=\"600\">logits at the last position</text>",
        top - 8.0
    );
    if !(lo.is_finite() && hi.is_finite()) {
        let _ = writeln!(
            h,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" font-size=\"13\">no finite \
             logits</text></svg>",
            left + pw / 2.0,
            top + ph / 2.0
        );
        return;
    }
    let (lo, hi) = if hi > lo {
        (f64::from(lo), f64::from(hi))
    } else {
        (f64::from(lo) - 0.5, f64::from(hi) + 0.5)
    };
    let bin_of = |v: f32| (((f64::from(v) - lo) / (hi - lo) * BINS as f64) as usize).min(BINS - 1);
    let counts: Vec<Vec<u64>> = last
        .iter()
        .map(|(_, r, _)| {
            let mut c = vec![0u64; BINS];
            for &v in r.iter().filter(|v| v.is_finite()) {
                c[bin_of(v)] += 1;
            }
            c
        })
        .collect();
    let max_count = counts.iter().flatten().copied().max().unwrap_or(1).max(1);
    let decades = (max_count as f64).log10().ceil().max(1.0);
    let y_of = |c: u64| top + ph * (1.0 - (1.0 + c as f64).log10() / (decades + 0.05).max(0.3));
    let x_of = |v: f64| left + pw * (v - lo) / (hi - lo);
    let bw = pw / BINS as f64;
    // Count ticks: 0, 1, 10, 100, …
    for e in 0..=decades as u32 + 1 {
        let c = if e == 0 { 0 } else { 10u64.pow(e - 1) };
        let y = y_of(c);
        let _ = write!(
            h,
            "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#e3e7ee\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{c}</text>",
            left + pw,
            left - 6.0,
            y + 4.0
        );
    }
    let scale = Scale::Linear { lo, hi };
    for (v, label) in scale.ticks() {
        let x = x_of(v);
        let _ = write!(
            h,
            "<line x1=\"{x:.1}\" y1=\"{:.1}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"#9aa0a8\"/>\
             <text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{label}</text>",
            top + ph,
            top + ph + 4.0,
            top + ph + 16.0
        );
    }
    let _ = write!(
        h,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">logit value \
         (bins of {})</text>",
        left + pw / 2.0,
        ht - 6.0,
        num((hi - lo) / BINS as f64)
    );
    for ((name, _, side), c) in last.iter().zip(&counts) {
        if *name == "reference" {
            for (b, &n) in c.iter().enumerate() {
                if n == 0 {
                    continue;
                }
                let y = y_of(n);
                let _ = write!(
                    h,
                    "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{:.1}\" \
                     fill=\"{REF_FILL}\"><title>reference: {n} logits in [{}, {})</title></rect>",
                    left + b as f64 * bw + 0.5,
                    (bw - 1.0).max(0.5),
                    top + ph - y,
                    num(lo + b as f64 * (hi - lo) / BINS as f64),
                    num(lo + (b + 1) as f64 * (hi - lo) / BINS as f64),
                );
            }
        } else {
            let mut d = format!("M{left:.1} {:.1}", top + ph);
            for (b, &n) in c.iter().enumerate() {
                let y = y_of(n);
                let _ = write!(
                    d,
                    " L{:.1} {y:.1} L{:.1} {y:.1}",
                    left + b as f64 * bw,
                    left + (b + 1) as f64 * bw
                );
            }
            let _ = write!(d, " L{:.1} {:.1}", left + pw, top + ph);
            let _ = write!(
                h,
                "<path d=\"{d}\" fill=\"none\" stroke=\"{CAND_STROKE}\" stroke-width=\"2\"/>"
            );
        }
        // The top-1 logit.
        let row = side.row(side.positions - 1);
        if let Some(t) = side.health.top1.last().copied() {
            let v = row[t];
            if v.is_finite() {
                let x = x_of(f64::from(v));
                let colour = if *name == "reference" {
                    REF_STROKE
                } else {
                    CAND_STROKE
                };
                let (y0, dy) = if *name == "reference" {
                    (top + 2.0, 9.0)
                } else {
                    (top + 14.0, 9.0)
                };
                let _ = write!(
                    h,
                    "<path d=\"M{:.1} {y0:.1} L{:.1} {y0:.1} L{x:.1} {:.1} Z\" fill=\"{colour}\">\
                     <title>{name} top-1: token {t}, logit {}</title></path><text x=\"{:.1}\" \
                     y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{name} top-1: {t}</text>",
                    x - 5.0,
                    x + 5.0,
                    y0 + dy,
                    num(f64::from(v)),
                    x - 8.0,
                    y0 + 8.0
                );
            }
        }
    }
    // Legend.
    let lx = left + pw - 190.0;
    let _ = write!(
        h,
        "<rect x=\"{lx:.1}\" y=\"{:.1}\" width=\"14\" height=\"10\" fill=\"{REF_FILL}\"/>\
         <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">reference</text>\
         <line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{CAND_STROKE}\" \
         stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">candidate</text>",
        top - 19.0,
        lx + 18.0,
        top - 10.0,
        lx + 90.0,
        top - 14.0,
        lx + 104.0,
        top - 14.0,
        lx + 108.0,
        top - 10.0
    );
    h.push_str("</svg>\n");
}

fn entropy_plot(h: &mut String, view: &LogitsView) {
    let (w, ht, left, right, top, bottom) = (W, 200.0, LEFT, RIGHT, 30.0, 36.0);
    let (pw, ph) = (w - left - right, ht - top - bottom);
    let sides: Vec<(&str, &LogitsSide, Vec<f64>)> = [
        ("reference", &view.reference),
        ("candidate", &view.candidate),
    ]
    .into_iter()
    .filter_map(|(n, s)| s.as_ref().map(|s| (n, s)))
    .map(|(n, s)| (n, s, (0..s.positions).map(|p| entropy(s.row(p))).collect()))
    .collect();
    let positions = sides.iter().map(|(_, s, _)| s.positions).max().unwrap_or(1);
    let ln_v = sides
        .iter()
        .map(|(_, s, _)| s.health.ln_vocab)
        .fold(0.0, f64::max);
    let y_hi = sides
        .iter()
        .flat_map(|(_, _, e)| e.iter().copied())
        .filter(|v| v.is_finite())
        .fold(ln_v, f64::max)
        * 1.05;
    let y_hi = if y_hi > 0.0 { y_hi } else { 1.0 };
    let scale = Scale::Linear { lo: 0.0, hi: y_hi };
    let x_of = |p: usize| {
        if positions <= 1 {
            left + pw / 2.0
        } else {
            left + pw * (p as f64 + 0.5) / positions as f64
        }
    };
    let _ = write!(
        h,
        "<svg id=\"entropy-plot\" width=\"{w}\" height=\"{ht}\" viewBox=\"0 0 {w} {ht}\" \
         role=\"img\" aria-labelledby=\"entropy-plot-title\"><title id=\"entropy-plot-title\">\
         Entropy per position, reference and candidate</title><rect x=\"{left}\" y=\"{top}\" \
         width=\"{pw}\" height=\"{ph}\" fill=\"#f7f9fc\" stroke=\"#9aa0a8\"/>\
         <text x=\"{left}\" y=\"{:.1}\" font-size=\"12.5\" font-weight=\"600\">entropy per \
         position (nats)</text>",
        top - 8.0
    );
    for (v, label) in scale.ticks() {
        if let Some(y) = scale.y(v, top, ph) {
            let _ = write!(
                h,
                "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#e3e7ee\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">{label}</text>",
                left + pw,
                left - 6.0,
                y + 4.0
            );
        }
    }
    if let Some(y) = scale.y(ln_v, top, ph) {
        let _ = write!(
            h,
            "<line x1=\"{left}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#555\" \
             stroke-dasharray=\"6 4\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" \
             text-anchor=\"end\">ln V = {ln_v:.3}</text>",
            left + pw,
            left + pw - 4.0,
            y - 4.0
        );
    }
    let every = nice_step((positions as f64 / 24.0).max(1.0)).max(1.0) as usize;
    for p in (0..positions).filter(|p| p % every == 0) {
        let x = x_of(p);
        let _ = write!(
            h,
            "<text x=\"{x:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{p}</text>",
            top + ph + 14.0
        );
    }
    let _ = write!(
        h,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">position</text>",
        left + pw / 2.0,
        ht - 4.0
    );
    for (name, _, ent) in &sides {
        let colour = if *name == "reference" {
            REF_STROKE
        } else {
            CAND_STROKE
        };
        let pts: Vec<Option<(f64, f64, String)>> = ent
            .iter()
            .enumerate()
            .map(|(p, &e)| Some((x_of(p), scale.y(e, top, ph)?, String::new())))
            .collect();
        polyline(h, &pts, colour, 2.0, None);
        for (p, pt) in pts.iter().enumerate() {
            if let Some((x, y, _)) = pt {
                let _ = write!(
                    h,
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2.6\" fill=\"{colour}\"><title>{name} \
                     position {p}: entropy {:.4}</title></circle>",
                    ent[p]
                );
            }
        }
    }
    if let [(_, r, _), (_, c, _)] = sides.as_slice() {
        for (p, (a, b)) in r.health.top1.iter().zip(&c.health.top1).enumerate() {
            if a != b {
                let (x, y) = (x_of(p), top + ph - 8.0);
                let _ = write!(
                    h,
                    "<path d=\"M{:.1} {:.1} L{:.1} {:.1} M{:.1} {:.1} L{:.1} {:.1}\" \
                     stroke=\"{ALARM}\" stroke-width=\"2\"><title>position {p}: top-1 {a} in the \
                     reference, {b} in the candidate</title></path>",
                    x - 4.0,
                    y - 4.0,
                    x + 4.0,
                    y + 4.0,
                    x - 4.0,
                    y + 4.0,
                    x + 4.0,
                    y - 4.0
                );
            }
        }
    }
    let lx = left + pw - 190.0;
    let _ = writeln!(
        h,
        "<line x1=\"{lx:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{REF_STROKE}\" \
         stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">reference</text>\
         <line x1=\"{:.1}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"{CAND_STROKE}\" \
         stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\">candidate</text>\
         </svg>",
        top - 14.0,
        lx + 16.0,
        top - 14.0,
        lx + 20.0,
        top - 10.0,
        lx + 90.0,
        top - 14.0,
        lx + 106.0,
        top - 14.0,
        lx + 110.0,
        top - 10.0
    );
}

// ---------------------------------------------------------------------------------------------
// Tables

fn per_layer_table(h: &mut String, report: &DiffReport) {
    let rows = layer_rows(report);
    if rows.is_empty() {
        return;
    }
    h.push_str(
        "<h2>Per layer</h2>\n<div class=\"scroll\"><table id=\"per-layer\"><tr>\
         <th class=\"l\">layer</th><th class=\"l\">worst stage</th><th>rel_diff</th>\
         <th class=\"l\">log 1e-12 … 1</th><th>min cosine</th><th class=\"l\">status</th></tr>\n",
    );
    for row in rows {
        let class = match (row.first, row.failed) {
            (true, _) => " class=\"first\"",
            (false, true) => " class=\"fail\"",
            _ => "",
        };
        let bar_class = if row.failed { "bar fail" } else { "bar" };
        let _ = writeln!(
            h,
            "<tr{class}><td class=\"l\">{}</td><td class=\"l\"><code>{}</code></td><td>{}</td>\
             <td class=\"l\"><span class=\"{bar_class}\" style=\"width:{:.0}px\"></span></td>\
             <td>{}</td><td class=\"l\">{}</td></tr>",
            esc(&row.label()),
            esc(&row.worst.stage),
            num(row.worst.rel_diff),
            (160.0 * log_level(row.worst.rel_diff)).max(1.0),
            row.min_cosine.map_or("-".into(), |c| format!("{c:.6}")),
            match (row.first, row.failed) {
                (true, _) => "FAIL ◀ first divergence",
                (false, true) => "FAIL",
                _ => "ok",
            }
        );
    }
    h.push_str("</table></div>\n");
}

fn notable_table(h: &mut String, report: &DiffReport) {
    let rows = notable_stages(report, 8);
    if rows.is_empty() {
        return;
    }
    h.push_str("<h2>Around the first divergence, and the worst stages</h2>\n");
    stage_table(h, report, rows, true);
}

/// A table of the stages at `rows`; `anchor` gives the first divergence's row its id.
fn stage_table(
    h: &mut String,
    report: &DiffReport,
    rows: impl IntoIterator<Item = usize>,
    anchor: bool,
) {
    h.push_str(
        "<div class=\"scroll\"><table class=\"stages\"><tr><th class=\"l\">stage</th>\
         <th class=\"l\">basis</th><th class=\"l\">status</th><th>cosine</th><th>rel_diff</th>\
         <th>tolerance</th><th>nmse</th><th>SQNR dB</th><th>max |Δ| (index)</th>\
         <th>mean |Δ|</th><th>norm ratio</th><th>× input</th><th>absmax ref / cand</th>\
         <th>NaN+Inf ref / cand</th></tr>\n",
    );
    for i in rows {
        let s = &report.stages[i];
        let first = is_first(report, s);
        let class = match (first, s.status) {
            (true, _) => " class=\"first\"",
            (false, Status::Fail) => " class=\"fail\"",
            _ => "",
        };
        let id = if first && anchor {
            " id=\"first-divergence\""
        } else {
            ""
        };
        let m = s.metrics.as_ref();
        let _ = writeln!(
            h,
            "<tr{class}{id}><td class=\"l\"><code>{}{}</code></td><td class=\"l\">{}</td>\
             <td class=\"l\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} / {}</td><td>{} / {}</td></tr>",
            if first { "▶ " } else { "" },
            esc(&stage_label(s)),
            basis_word(s.basis),
            match s.status {
                Status::Pass => "ok",
                Status::Fail => "FAIL",
            },
            m.map_or("-".into(), |m| format!("{:.6}", m.cosine)),
            num(s.rel_diff),
            num(s.tolerance),
            m.map_or("-".into(), |m| num(m.nmse)),
            m.map_or("-".into(), |m| if m.sqnr_db.is_finite() {
                format!("{:.1}", m.sqnr_db)
            } else {
                "∞".into()
            }),
            m.map_or("-".into(), |m| format!(
                "{} ({})",
                num(m.max_abs),
                m.max_abs_index
            )),
            m.map_or("-".into(), |m| num(m.mean_abs)),
            m.map_or("-".into(), |m| format!("{:.4}", m.norm_ratio)),
            s.amplification.map_or("-".into(), num),
            num(s.reference.absmax),
            num(s.candidate.absmax),
            s.reference.non_finite(),
            s.candidate.non_finite(),
        );
    }
    h.push_str("</table></div>\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_text_is_escaped() {
        assert_eq!(
            esc("<script>\"a\" & 'b'</script>"),
            "&lt;script&gt;&quot;a&quot; &amp; &#39;b&#39;&lt;/script&gt;"
        );
    }

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
