//! `glmcheck diff`'s report on a terminal: the verdict, the first divergence and its fault, a
//! per-layer table with an error bar on a log scale, and the stages worth a look.

use std::fmt::Write;

use super::num;
use super::terminal::table;
use crate::compare::DiffReport;

/// A bar of `width` cells for an error on a log scale from 1e-12 (empty) to 1 (full).
fn bar(rel_diff: f64, width: usize) -> String {
    let filled = (super::log_level(rel_diff) * width as f64).round() as usize;
    format!("{}{}", "█".repeat(filled), "·".repeat(width - filled))
}

/// The verdict, the first divergence and its fault, the per-layer table and the stages around
/// the first divergence and the worst ones.
pub fn text(report: &DiffReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} against {} (candidate dtype {}, tolerance: {})",
        super::headline(report),
        report.candidate,
        report.reference,
        report.candidate_dtype,
        report.tolerance_source
    );
    if let Some(note) = super::partial_note(report) {
        let _ = writeln!(out, "{note}");
    }
    if let Some(d) = &report.first_divergence {
        let rank = d.rank.map(|r| format!(" rank {r}")).unwrap_or_default();
        let _ = writeln!(out, "first divergence: {}{rank}", d.stage);
    }
    if let Some(f) = &report.fault {
        let _ = writeln!(out, "fault: {} — {}", f.class.name(), f.summary);
        for e in &f.evidence {
            let _ = writeln!(out, "  · {e}");
        }
    }
    let _ = writeln!(
        out,
        "a tolerance of {} would pass every value stage",
        num(report.tolerance_to_pass)
    );

    let _ = writeln!(
        out,
        "\nper layer (worst stage; bar: rel_diff on a log scale from 1e-12 to 1)"
    );
    let mut t = table(&["layer", "worst stage", "rel_diff", "", "status"]);
    for row in super::layer_rows(report) {
        t.add_row(vec![
            row.layer.map_or("-".into(), |l| l.to_string()),
            row.worst.stage.clone(),
            num(row.worst.rel_diff),
            bar(row.worst.rel_diff, 24),
            if row.failed {
                "FAIL".into()
            } else {
                "ok".into()
            },
        ]);
    }
    let _ = writeln!(out, "{t}");

    let _ = writeln!(
        out,
        "\nstages around the first divergence and the worst ones"
    );
    let mut t = table(&[
        "stage",
        "basis",
        "status",
        "cosine",
        "rel_diff",
        "tolerance",
        "norm ratio",
        "max |Δ|",
        "× input",
    ]);
    for i in super::notable_stages(report, 5) {
        let s = &report.stages[i];
        let m = s.metrics.as_ref();
        let mark = if super::is_first(report, s) {
            "▶ "
        } else {
            ""
        };
        t.add_row(vec![
            format!("{mark}{}", super::stage_label(s)),
            super::basis_word(s.basis).into(),
            super::verdict_word(s.status).into(),
            m.map_or("-".into(), |m| format!("{:.6}", m.cosine)),
            num(s.rel_diff),
            num(s.tolerance),
            m.map_or("-".into(), |m| format!("{:.4}", m.norm_ratio)),
            m.map_or("-".into(), |m| num(m.max_abs)),
            super::growth(s.amplification),
        ]);
    }
    let _ = writeln!(out, "{t}");
    out
}
