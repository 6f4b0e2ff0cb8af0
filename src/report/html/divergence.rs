//! The per-layer divergence plot: one column per layer (and per stage outside the layers), three
//! panels (`rel_diff` on a log axis, cosine, norm ratio), one series per stage kind, the most
//! departed stage and the tolerance of each column, the first divergence and new NaN/Inf marked.

use std::collections::BTreeMap;
use std::fmt::Write;

use super::svg::{hex, nice_step, polyline, Scale, ALARM, LEFT, RIGHT, W};
use super::{esc, DIVERGENCE_BAND, PLOT_BACKGROUND, PLOT_ID, PRIMARY_STROKE};
use crate::compare::stage_diff::Basis;
use crate::compare::{DiffReport, StageDiff, Status};
use crate::model::stage::kind_of;
use crate::report::num;

/// Series colours after [`PRIMARY_STROKE`].
const PALETTE: [&str; 5] = ["#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
const WORST_STROKE: &str = "#a0a4ab";
const TOLERANCE_STROKE: &str = "#444b55";

/// Stage kinds drawn as series, in this order, when the traces hold them.
const PREFERRED_KINDS: [&str; 4] = ["out", "attn.out", "ffn.out", "moe.routed"];

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

pub(super) fn divergence_plot(h: &mut String, report: &DiffReport) {
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
