//! `glmcheck diff REF CAND`: per-stage metrics, the first divergence and its class; a table on a
//! terminal, JSON with `--json`, Markdown with `--markdown`, and with `--html OUT` also a
//! self-contained HTML report.

use std::path::PathBuf;

use anyhow::Context;

use super::Outcome;
use crate::compare::{diff, DiffOptions, DiffReport};
use crate::report::terminal::table;
use crate::report::{self, num, LogitsView};
use crate::trace::Trace;

#[derive(clap::Args, Debug)]
pub struct DiffArgs {
    /// The reference trace (`NAME.trace`).
    pub reference: PathBuf,
    /// The candidate trace.
    pub candidate: PathBuf,
    /// The reference run again at the candidate's dtype: each stage may depart 10× as far as
    /// this envelope does.
    #[arg(long, value_name = "TRACE", conflicts_with = "tolerance")]
    pub envelope: Option<PathBuf>,
    /// One rel_diff tolerance for every stage (default by the candidate's dtype: f32 1e-8,
    /// f16 1e-4, bf16 1e-3).
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// GitHub-flavoured Markdown on stdout instead of the table (verdict, first divergence,
    /// fault with evidence, logits, per-layer table, worst stages): for CI job summaries, e.g.
    /// `>> "$GITHUB_STEP_SUMMARY"`.
    #[arg(long, conflicts_with = "json")]
    pub markdown: bool,
    /// Also write a self-contained HTML report to OUT (no network, no JavaScript): verdict,
    /// fault, a per-layer plot of rel_diff, cosine and norm ratio per stage kind with the first
    /// divergence marked, the logits' health and histogram, and the stage tables.
    #[arg(long, value_name = "OUT")]
    pub html: Option<PathBuf>,
}

pub fn run(args: DiffArgs) -> anyhow::Result<Outcome> {
    let (reference, candidate) = (Trace::open(&args.reference)?, Trace::open(&args.candidate)?);
    let envelope = args.envelope.as_deref().map(Trace::open).transpose()?;
    let opts = DiffOptions {
        tolerance: args.tolerance,
        envelope: envelope.as_ref(),
    };
    let report = diff(&reference, &candidate, &opts)?;
    let logits = if args.markdown || args.html.is_some() {
        LogitsView::read(&reference, &candidate)?
    } else {
        None
    };
    if let Some(out) = &args.html {
        std::fs::write(out, report::html(&report, logits.as_ref()))
            .with_context(|| format!("{}: writing the HTML report", out.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else if args.markdown {
        print!("{}", report::markdown(&report, logits.as_ref()));
    } else {
        print_report(&report);
    }
    Ok(Outcome::of(
        report.first_divergence.is_some(),
        report.partial.any(),
    ))
}

/// A bar of `width` cells for an error on a log scale from 1e-12 (empty) to 1 (full).
fn bar(rel_diff: f64, width: usize) -> String {
    let filled = (report::log_level(rel_diff) * width as f64).round() as usize;
    format!("{}{}", "█".repeat(filled), "·".repeat(width - filled))
}

pub(super) fn print_report(report: &DiffReport) {
    println!(
        "{}: {} against {} (candidate dtype {}, tolerance: {})",
        report::headline(report),
        report.candidate,
        report.reference,
        report.candidate_dtype,
        report.tolerance_source
    );
    if let Some(note) = report::partial_note(report) {
        println!("{note}");
    }
    if let Some(d) = &report.first_divergence {
        let rank = d.rank.map(|r| format!(" rank {r}")).unwrap_or_default();
        println!("first divergence: {}{rank}", d.stage);
    }
    if let Some(f) = &report.fault {
        println!("fault: {} — {}", f.class.name(), f.summary);
        for e in &f.evidence {
            println!("  · {e}");
        }
    }
    println!(
        "a tolerance of {} would pass every value stage",
        num(report.tolerance_to_pass)
    );

    println!("\nper layer (worst stage; bar: rel_diff on a log scale from 1e-12 to 1)");
    let mut t = table(&["layer", "worst stage", "rel_diff", "", "status"]);
    for row in report::layer_rows(report) {
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
    println!("{t}");

    println!("\nstages around the first divergence and the worst ones");
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
    for i in report::notable_stages(report, 5) {
        let s = &report.stages[i];
        let m = s.metrics.as_ref();
        let mark = if report::is_first(report, s) {
            "▶ "
        } else {
            ""
        };
        t.add_row(vec![
            format!("{mark}{}", report::stage_label(s)),
            report::basis_word(s.basis).into(),
            report::verdict_word(s.status).into(),
            m.map_or("-".into(), |m| format!("{:.6}", m.cosine)),
            num(s.rel_diff),
            num(s.tolerance),
            m.map_or("-".into(), |m| format!("{:.4}", m.norm_ratio)),
            m.map_or("-".into(), |m| num(m.max_abs)),
            report::growth(s.amplification),
        ]);
    }
    println!("{t}");
}
