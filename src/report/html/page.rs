//! The document: head and inline CSS, the verdict banner, the fault box, and the sections in
//! their order, with the escaping (`report::escape`) every part uses for text from a trace.

use std::fmt::Write;

use super::divergence::divergence_plot;
use super::logits::logits_section;
use super::tables::{notable_table, per_layer_table, stage_table};
use crate::compare::{DiffReport, Status};
use crate::report::{headline, num, LogitsView};

pub use crate::report::escape::markup as esc;

/// The style of every HTML report (diff's and endpoint's): one look, written once.
pub(crate) const CSS: &str = r#"
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
