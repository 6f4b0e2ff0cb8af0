//! The gate's verdict as GitHub-flavoured Markdown for a CI job summary: the verdict, what was
//! compared, a table of every broken check, and the notes (near ties not judged).

use std::fmt::Write;

use crate::compare::Status;
use crate::gate::check::GateReport;
use crate::report::markdown::{code, text};

/// At most this many broken checks are listed; the rest are counted.
const MAX_ROWS: usize = 200;

fn value(v: Option<f64>) -> String {
    v.map_or("–".into(), |v| format!("{v:.9e}"))
}

/// The report as Markdown.
pub fn markdown(report: &GateReport) -> String {
    let mut m = String::new();
    let verdict = match (report.verdict, report.regressed()) {
        (Status::Pass, _) => "✅ pass",
        (Status::Fail, true) => "❌ regression",
        (Status::Fail, false) => "❌ partial trace",
    };
    let _ = writeln!(m, "### glmcheck gate: {verdict}\n");
    let _ = writeln!(
        m,
        "{} against baseline {} ({}, TP {}, ε = {:.3e}): {} of {} checks broke.\n",
        code(&report.candidate),
        code(&report.baseline),
        text(&report.dtype),
        report.tp,
        report.epsilon,
        report.failed,
        report.checked
    );
    let rows: Vec<(String, &crate::gate::check::Broken)> = report
        .failures()
        .flat_map(|s| s.failures.iter().map(move |f| (s.label(), f)))
        .collect();
    if !rows.is_empty() {
        m.push_str("| stage | check | baseline | candidate | limit | why |\n");
        m.push_str("|---|---|---:|---:|---:|---|\n");
        for (stage, f) in rows.iter().take(MAX_ROWS) {
            let _ = writeln!(
                m,
                "| {} | {} | {} | {} | {} | {} |",
                code(stage),
                text(&f.check),
                value(f.baseline),
                value(f.candidate),
                value(f.limit),
                text(&f.why)
            );
        }
        if rows.len() > MAX_ROWS {
            let _ = writeln!(m, "\n… and {} more.", rows.len() - MAX_ROWS);
        }
        m.push('\n');
    }
    for n in &report.notes {
        let _ = writeln!(m, "* {}", text(n));
    }
    m
}
