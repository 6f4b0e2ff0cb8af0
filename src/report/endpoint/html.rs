//! `glmcheck endpoint --html`: the report as one self-contained HTML page, in the look of
//! diff's (`report::html`: its style, its escaping, its SVG axes). No network, no JavaScript: a
//! verdict banner, the problems, per prompt a chart of |Δ logprob| and KL per position on a log
//! axis (the tolerance and the first parting marked) with the comparison's tables, the
//! concurrency check, and the explanation's ranking with a bar per score. Every string from
//! outside (the URL, the model names, the problems) is escaped with `report::html::esc`.

use std::fmt::Write;

use super::markdown::{api_words, explain_words, tolerance};
use super::SHOWN_POSITIONS;
use super::{
    continuations, ConcurrencyCheck, EndpointReport, ExplainVerdict, Explanation, PromptCheck,
};
use crate::compare::top_k::PositionDiff;
use crate::compare::Status;
use crate::report::html::svg::{nice_step, polyline, Scale, ALARM, LEFT, RIGHT, W};
use crate::report::html::{esc, CSS};
use crate::report::{num, verdict_word};

/// What this page adds to diff's style: the ranking's best fit (green: a fault named, not a
/// failure) and clean model, and table cells whose text wraps.
const EXTRA_CSS: &str = "
tr.best td { background: #e6f4ea; font-weight: 600; }
.bar.best { background: #1e7f3c; }
.bar.clean { background: #5b7db1; }
table.kv td { white-space: normal; text-align: left; }
";

const DELTA_STROKE: &str = "#3182bd";
const KL_STROKE: &str = "#ff7f0e";
const TOLERANCE_STROKE: &str = "#444b55";

/// Above this many positions the charts draw lines only: a marker (with its tooltip) per
/// position would make a long prompt's page heavy and unreadable.
const MARKED_POSITIONS: usize = 256;

/// The longest bar of the ranking, in pixels.
const BAR_PX: f64 = 200.0;

/// The report as one HTML document.
pub fn html(r: &EndpointReport) -> String {
    let mut h = String::with_capacity(32 * 1024);
    let verdict = verdict_word(r.verdict);
    let class = status_class(r.verdict);
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>glmcheck endpoint: {verdict} — {}</title>\n<style>{CSS}{EXTRA_CSS}</style>\n\
         </head>\n<body>\n<header class=\"banner {class}\" id=\"verdict\"><h1>{verdict}</h1>\
         <p><code>{}</code> ({}) serving <code>{}</code> against the reference on \
         <code>{}</code></p><p>top-{} log-probabilities at every prompt position",
        esc(&r.url),
        esc(&r.url),
        api_words(r.api),
        esc(&r.served_model),
        esc(&r.model),
        r.top_k_served
    );
    if let Some(t) = tolerance(r) {
        let _ = write!(h, " · tolerance {t} nats");
    }
    let _ = write!(h, " · {} prompt(s)", r.prompts.len());
    if let Some((p, part)) = r
        .prompts
        .iter()
        .find_map(|p| p.comparison.first_parting.as_ref().map(|part| (p, part)))
    {
        let _ = write!(
            h,
            " · first parting: <a href=\"#prompt-{}\">prompt {}, position {}</a>",
            p.index, p.index, part.position
        );
    }
    h.push_str("</p></header>\n<main>\n");

    if r.problems.is_empty() {
        h.push_str(
            "<section class=\"fault none\" id=\"problems\"><h2>The server agrees with the \
             reference</h2></section>\n",
        );
    } else {
        h.push_str("<section class=\"fault\" id=\"problems\"><h2>Problems</h2><ul>");
        for p in &r.problems {
            let _ = write!(h, "<li>{}</li>", esc(p));
        }
        h.push_str("</ul></section>\n");
    }
    for p in &r.prompts {
        prompt(&mut h, p);
    }
    if let Some(c) = &r.concurrency {
        concurrency(&mut h, c);
    }
    if let Some(e) = &r.explanation {
        explanation(&mut h, e);
    }
    let _ = write!(
        h,
        "<footer>glmcheck {} · <code>glmcheck endpoint</code> report; self-contained, no scripts, \
         no network.</footer>\n</main>\n</body>\n</html>\n",
        env!("CARGO_PKG_VERSION")
    );
    h
}

fn status_class(s: Status) -> &'static str {
    match s {
        Status::Pass => "pass",
        Status::Fail => "fail",
    }
}

fn prompt(h: &mut String, p: &PromptCheck) {
    let c = &p.comparison;
    let hl = &p.health;
    let _ = write!(
        h,
        "<h2 id=\"prompt-{}\">Prompt {}: {} tokens — {}</h2>\n<p class=\"muted\">server {:.2} s, \
         reference {:.2} s</p>\n<figure>\n",
        p.index,
        p.index,
        p.tokens,
        verdict_word(p.verdict),
        p.server_seconds,
        p.reference_seconds
    );
    chart(h, p);
    h.push_str(
        "<figcaption>Per prompt position (the distribution of the next token): the largest \
         |Δ logprob| among the tokens the server listed, and KL(reference ‖ server) over them \
         and the rest, on a log axis (0 on the bottom edge). The dashed line is the tolerance \
         on |Δ logprob|; red markers lie beyond it; the red line marks the first parting. \
         Hover a marker for its values.</figcaption>\n</figure>\n",
    );
    let rows = [
        (
            "KL(reference ‖ server), top-k + rest",
            format!("mean {} max {}", num(c.kl_mean), num(c.kl_max)),
        ),
        (
            "top-1 agreement",
            format!("{:.1} %", 100.0 * c.top1_agreement),
        ),
        (
            "Δp of the reference's top-1",
            format!("mean {} min {}", num(c.delta_p_mean), num(c.delta_p_min)),
        ),
        (
            "max |Δ logprob| (shared tokens)",
            format!(
                "{} (tolerance {})",
                num(c.max_abs_delta_logprob),
                c.tolerance
            ),
        ),
        (
            "first parting",
            match &c.first_parting {
                Some(part) => format!(
                    "position {} of {}: {} ({} positions part)",
                    part.position, c.positions, part.reason, c.parted
                ),
                None => format!("none of {} positions", c.positions),
            },
        ),
        (
            "top-1 probability: server / reference",
            format!(
                "{:.4} / {:.4} (1/V = {}){}",
                hl.top1_prob_mean,
                hl.reference_top1_prob_mean,
                num(hl.uniform),
                if hl.flat { ", flat" } else { "" }
            ),
        ),
        ("non-finite log-probabilities", hl.non_finite.to_string()),
        ("continuation: server / reference", continuations(p)),
    ];
    let _ = write!(
        h,
        "<div class=\"scroll\"><table class=\"kv\" id=\"prompt-{}-comparison\">",
        p.index
    );
    for (name, value) in rows {
        let _ = write!(
            h,
            "<tr><th class=\"l\">{}</th><td>{}</td></tr>",
            esc(name),
            esc(&value)
        );
    }
    h.push_str("</table></div>\n");
    let Some(part) = &c.first_parting else {
        return;
    };
    let _ = write!(
        h,
        "<h3>From the first parting</h3>\n<div class=\"scroll\"><table id=\"prompt-{}-parting\">\
         <tr><th>position</th><th>top-1 ref</th><th>top-1 server</th><th>KL</th><th>Δp</th>\
         <th>max |Δ logprob|</th></tr>\n",
        p.index
    );
    for d in c
        .per_position
        .iter()
        .skip_while(|d| d.position != part.position)
        .take(SHOWN_POSITIONS)
    {
        let class = if d.position == part.position {
            " class=\"first\""
        } else if d.max_abs_delta_logprob > c.tolerance {
            " class=\"fail\""
        } else {
            ""
        };
        let _ = writeln!(
            h,
            "<tr{class}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            d.position,
            d.reference_top1,
            d.server_top1,
            num(d.kl),
            num(d.delta_p),
            num(d.max_abs_delta_logprob)
        );
    }
    h.push_str("</table></div>\n");
}

/// The tooltip of one position's markers.
fn tip(d: &PositionDiff) -> String {
    format!(
        "position {}: max |Δ logprob| {}, KL {}, top-1 {} in the reference, {} on the server",
        d.position,
        num(d.max_abs_delta_logprob),
        num(d.kl),
        d.reference_top1,
        d.server_top1
    )
}

/// |Δ logprob| and KL per position on one log axis, the tolerance and the first parting marked.
fn chart(h: &mut String, p: &PromptCheck) {
    let c = &p.comparison;
    let (ht, top, bottom) = (240.0, 30.0, 36.0);
    let (pw, ph) = (W - LEFT - RIGHT, ht - top - bottom);
    let n = c.per_position.len();
    let scale = Scale::log_of(
        c.per_position
            .iter()
            .flat_map(|d| [d.kl, d.max_abs_delta_logprob])
            .chain([c.tolerance]),
    );
    let x_of = |i: usize| {
        if n <= 1 {
            LEFT + pw / 2.0
        } else {
            LEFT + pw * (i as f64 + 0.5) / n as f64
        }
    };
    let id = format!("prompt-{}-chart", p.index);
    let _ = write!(
        h,
        "<svg id=\"{id}\" width=\"{W}\" height=\"{ht}\" viewBox=\"0 0 {W} {ht}\" role=\"img\" \
         aria-labelledby=\"{id}-title\"><title id=\"{id}-title\">Prompt {}: max |Δ logprob| \
         and KL per position</title><rect x=\"{LEFT}\" y=\"{top}\" width=\"{pw}\" \
         height=\"{ph}\" fill=\"#f7f9fc\" stroke=\"#9aa0a8\"/><text x=\"{LEFT}\" y=\"{:.1}\" \
         font-size=\"12.5\" font-weight=\"600\">per position (log axis)</text>",
        p.index,
        top - 8.0
    );
    scale.gridlines(h, LEFT, pw, top, ph);
    if let Some(y) = scale.y(c.tolerance, top, ph) {
        let _ = write!(
            h,
            "<line x1=\"{LEFT}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" \
             stroke=\"{TOLERANCE_STROKE}\" stroke-dasharray=\"6 4\"/><text x=\"{:.1}\" \
             y=\"{:.1}\" font-size=\"11\" text-anchor=\"end\">tolerance {}</text>",
            LEFT + pw,
            LEFT + pw - 4.0,
            y - 4.0,
            c.tolerance
        );
    }
    if let Some(part) = &c.first_parting {
        if let Some(i) = c
            .per_position
            .iter()
            .position(|d| d.position == part.position)
        {
            let x = x_of(i);
            let _ = write!(
                h,
                "<line x1=\"{x:.1}\" y1=\"{top}\" x2=\"{x:.1}\" y2=\"{:.1}\" stroke=\"{ALARM}\" \
                 stroke-width=\"1.5\"><title>first parting: position {}</title></line>\
                 <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" fill=\"{ALARM}\">first parting: \
                 position {}</text>",
                top + ph,
                part.position,
                x + 4.0,
                top + 12.0,
                part.position
            );
        }
    }
    let every = nice_step((n as f64 / 24.0).max(1.0)).max(1.0) as usize;
    for (i, d) in c
        .per_position
        .iter()
        .enumerate()
        .filter(|(i, _)| i % every == 0)
    {
        let _ = write!(
            h,
            "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" text-anchor=\"middle\">{}</text>",
            x_of(i),
            top + ph + 14.0,
            d.position
        );
    }
    let _ = write!(
        h,
        "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"12\" text-anchor=\"middle\">position</text>",
        LEFT + pw / 2.0,
        ht - 4.0
    );
    type Series = (&'static str, fn(&PositionDiff) -> f64);
    let series: [Series; 2] = [
        (KL_STROKE, |d| d.kl),
        (DELTA_STROKE, |d| d.max_abs_delta_logprob),
    ];
    for (stroke, value) in series {
        let pts: Vec<Option<(f64, f64, String)>> = c
            .per_position
            .iter()
            .enumerate()
            .map(|(i, d)| Some((x_of(i), scale.y(value(d), top, ph)?, String::new())))
            .collect();
        polyline(h, &pts, stroke, 2.0, None);
        for (d, pt) in c.per_position.iter().zip(&pts) {
            let Some((x, y, _)) = pt else { continue };
            let beyond = stroke == DELTA_STROKE && d.max_abs_delta_logprob > c.tolerance;
            if n > MARKED_POSITIONS && !beyond {
                continue;
            }
            let _ = write!(
                h,
                "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"{}\" fill=\"{}\"><title>{}</title>\
                 </circle>",
                if beyond { 3.4 } else { 2.6 },
                if beyond { ALARM } else { stroke },
                tip(d)
            );
        }
    }
    let (lx, ly, ty) = (LEFT + pw - 300.0, top - 14.0, top - 10.0);
    let _ = writeln!(
        h,
        "<line x1=\"{lx:.1}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" \
         stroke=\"{DELTA_STROKE}\" stroke-width=\"2\"/><text x=\"{:.1}\" y=\"{ty:.1}\" \
         font-size=\"12\">max |Δ logprob|</text><line x1=\"{:.1}\" y1=\"{ly:.1}\" \
         x2=\"{:.1}\" y2=\"{ly:.1}\" stroke=\"{KL_STROKE}\" stroke-width=\"2\"/>\
         <text x=\"{:.1}\" y=\"{ty:.1}\" font-size=\"12\">KL</text></svg>",
        lx + 16.0,
        lx + 20.0,
        lx + 140.0,
        lx + 156.0,
        lx + 160.0,
    );
}

fn concurrency(h: &mut String, c: &ConcurrencyCheck) {
    let _ = write!(
        h,
        "<h2 id=\"concurrency\">Concurrency — {}</h2>\n<p>Each prompt asked {} time(s) beside {} \
         other requests, against its answer alone (tolerance {} nats).</p>\n<div \
         class=\"scroll\"><table id=\"concurrency-table\"><tr><th>prompt</th>\
         <th>max |Δ logprob|</th><th class=\"l\">where</th><th>top-1 changed</th>\
         <th class=\"l\">continuation differs</th><th>seconds</th></tr>\n",
        verdict_word(c.verdict),
        c.rounds,
        c.beside,
        c.tolerance
    );
    for p in &c.prompts {
        let d = &p.drift;
        let class = if d.max_abs_delta_logprob > c.tolerance {
            " class=\"fail\""
        } else {
            ""
        };
        let _ = writeln!(
            h,
            "<tr{class}><td>{}</td><td>{}</td><td class=\"l\">{}</td><td>{} of {}</td>\
             <td class=\"l\">{}</td><td>{:.2}</td></tr>",
            p.index,
            num(d.max_abs_delta_logprob),
            d.at.as_ref().map_or("-".into(), |a| format!(
                "position {}, token {} ({} alone, {} beside others)",
                a.position,
                a.token,
                num(a.alone),
                num(a.beside_others)
            )),
            d.top1_changed.len(),
            d.positions,
            p.continuation_differs_at
                .map_or("no".into(), |i| format!("from token {i}")),
            p.seconds
        );
    }
    h.push_str("</table></div>\n");
}

fn explanation(h: &mut String, e: &Explanation) {
    let class = match e.verdict {
        ExplainVerdict::Explained => "fault",
        ExplainVerdict::Ambiguous | ExplainVerdict::Unexplained => "fault mild",
        ExplainVerdict::NothingToExplain => "fault none",
    };
    let _ = write!(
        h,
        "<h2 id=\"explain\">Which catalogued fault fits</h2>\n<p class=\"muted\">TP {}, {}: {} \
         runs, {:.2} s</p>\n<section class=\"{class}\" id=\"explain-verdict\"><h2>{}</h2>\
         <p>{}</p></section>\n",
        e.tp,
        esc(e.dtype),
        e.ranking.len(),
        e.seconds,
        explain_words(e.verdict),
        esc(&e.conclusion)
    );
    if !e.ranking.is_empty() {
        let scale = Scale::log_of(e.ranking.iter().map(|h| h.score));
        let axis = match scale {
            Scale::Log { lo, hi } => format!("log 1e{lo} … 1e{hi}"),
            Scale::Linear { lo, hi } => format!("linear {} … {}", num(lo), num(hi)),
        };
        let _ = writeln!(
            h,
            "<div class=\"scroll\"><table id=\"ranking\"><tr><th>rank</th>\
             <th class=\"l\">hypothesis</th><th>score (nats)</th><th class=\"l\">score, {axis} \
             (shorter fits better)</th><th>seconds</th></tr>"
        );
        for (i, hyp) in e.ranking.iter().enumerate() {
            let named = i == 0 && e.verdict == ExplainVerdict::Explained;
            let bar = if hyp.name == "clean" {
                "bar clean"
            } else if named {
                "bar best"
            } else {
                "bar"
            };
            // The axis's pixel height read as a length: 0 (or below the axis) is the shortest.
            let px = scale
                .y(hyp.score, 0.0, BAR_PX)
                .map_or(BAR_PX, |y| BAR_PX - y)
                .max(1.0);
            let _ = writeln!(
                h,
                "<tr{}><td>{}</td><td class=\"l\"><code>{}</code></td><td>{}</td>\
                 <td class=\"l\"><span class=\"{bar}\" style=\"width:{px:.0}px\"></span></td>\
                 <td>{:.2}</td></tr>",
                if named { " class=\"best\"" } else { "" },
                i + 1,
                esc(&hyp.name),
                num(hyp.score),
                hyp.seconds
            );
        }
        h.push_str("</table></div>\n");
    }
    let notes: Vec<&String> = e.not_tried.iter().chain(&e.failed).collect();
    if !notes.is_empty() {
        h.push_str("<ul class=\"muted\">");
        for n in notes {
            let _ = write!(h, "<li>{}</li>", esc(n));
        }
        h.push_str("</ul>\n");
    }
    if e.verdict != ExplainVerdict::NothingToExplain {
        let _ = writeln!(h, "<p class=\"muted\">Rule: {}</p>", esc(e.rule));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::endpoint::markdown::tests::failing_report;

    #[test]
    fn a_hostile_served_model_name_is_escaped_everywhere() {
        let page = html(&failing_report("<script>|*_"));
        assert!(!page.contains("<script"), "{page}");
        assert!(page.contains("serving <code>&lt;script&gt;|*_</code>"));
        assert!(page.contains("(served &lt;script&gt;|*_)"));
        assert!(!page.contains("href=\"http") && !page.contains("src="));
    }

    #[test]
    fn a_failing_report_draws_its_parting_concurrency_and_ranking() {
        let page = html(&failing_report("served"));
        assert!(page.contains("<header class=\"banner fail\" id=\"verdict\"><h1>FAIL</h1>"));
        assert!(page.contains("first parting: <a href=\"#prompt-1\">prompt 1, position 2</a>"));
        // The chart: its axis, the tolerance line, the first parting, a red marker beyond.
        let chart = &page[page.find("<svg id=\"prompt-1-chart\"").unwrap()..];
        let chart = &chart[..chart.find("</svg>").unwrap()];
        assert!(chart.contains(">tolerance 0.5</text>"), "{chart}");
        assert!(
            chart.contains(">first parting: position 2</text>"),
            "{chart}"
        );
        assert!(chart.contains(&format!("fill=\"{ALARM}\"><title>position 2:")));
        assert_eq!(chart.matches("<polyline").count(), 2, "KL and |Δ logprob|");
        assert!(page.contains("<tr class=\"first\"><td>2</td><td>7</td><td>7</td>"));
        assert!(page.contains("<h2 id=\"concurrency\">Concurrency — FAIL</h2>"));
        assert!(page.contains("position 4, token 11 (-0.5000 alone, -1.7500 beside others)"));
        assert!(page.contains("<h2>explained</h2><p>rope-neox explains it"));
        // The best fit's bar is the shortest: 2e-6 on an axis from 1e-6.
        let best = page.find("<code>rope-neox</code>").unwrap();
        let row = &page[best..best + page[best..].find("</tr>").unwrap()];
        assert!(row.contains("class=\"bar best\""), "{row}");
        let width = |row: &str| -> f64 {
            let at = row.find("width:").unwrap() + 6;
            row[at..at + row[at..].find("px").unwrap()].parse().unwrap()
        };
        let clean = page.find("<code>clean</code>").unwrap();
        let clean_row = &page[clean..clean + page[clean..].find("</tr>").unwrap()];
        assert!(width(row) < width(clean_row) / 2.0, "{row} {clean_row}");
        assert!(page.contains("<li>fp16-overflow not tried: needs --dtype f16</li>"));
        assert!(!page.contains("<script") && !page.contains("href=\"http"));
    }
}
