//! The stage tables: the worst stage of each layer, the stages around the first divergence and
//! the worst ones, and every stage.

use std::fmt::Write;

use super::esc;
use crate::compare::{DiffReport, Status};
use crate::report::{
    basis_word, growth, is_first, layer_rows, log_level, notable_stages, num, stage_label,
};

pub(super) fn per_layer_table(h: &mut String, report: &DiffReport) {
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

pub(super) fn notable_table(h: &mut String, report: &DiffReport) {
    let rows = notable_stages(report, 8);
    if rows.is_empty() {
        return;
    }
    h.push_str("<h2>Around the first divergence, and the worst stages</h2>\n");
    stage_table(h, report, rows, true);
}

/// A table of the stages at `rows`; `anchor` gives the first divergence's row its id.
pub(super) fn stage_table(
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
            growth(s.amplification),
            num(s.reference.absmax),
            num(s.candidate.absmax),
            s.reference.non_finite(),
            s.candidate.non_finite(),
        );
    }
    h.push_str("</table></div>\n");
}
