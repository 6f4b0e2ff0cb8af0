//! The logits section: each side's health and their comparison as tables, a histogram of the
//! last position's logits and the entropy per position, reference against candidate.

use std::fmt::Write;

use super::svg::{gridline, nice_step, polyline, Scale, ALARM, LEFT, RIGHT, W};
use super::{esc, HISTOGRAM_ID};
use crate::report::{num, LogitsSide, LogitsView};

const REF_FILL: &str = "#9ecae1";
const REF_STROKE: &str = "#3182bd";
const CAND_STROKE: &str = "#ff7f0e";

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

pub(super) fn logits_section(h: &mut String, view: &LogitsView) {
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
        gridline(h, left, pw, y_of(c), &c.to_string());
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
    scale.gridlines(h, left, pw, top, ph);
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
