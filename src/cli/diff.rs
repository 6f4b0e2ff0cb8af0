//! `glmcheck diff REF CAND`: per-stage metrics, the first divergence and its class; a table on a
//! terminal, JSON with `--json`, Markdown with `--markdown`, and with `--html OUT` also a
//! self-contained HTML report.

use std::path::PathBuf;

use anyhow::Context;

use super::Outcome;
use crate::compare::{diff, DiffOptions};
use crate::report::{self, LogitsView};
use crate::trace::{sglang, Trace};

#[derive(clap::Args, Debug)]
pub struct DiffArgs {
    /// The reference trace (`NAME.trace`).
    pub reference: PathBuf,
    /// The candidate trace, or a folder of SGLang's own dumps (read against the reference's
    /// config).
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
    let reference = Trace::open(&args.reference)?;
    let candidate = sglang::open_against(&args.candidate, &reference)?;
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
        print!("{}", report::diff::text(&report));
    }
    Ok(Outcome::of(
        report.first_divergence.is_some(),
        report.partial.any(),
    ))
}
