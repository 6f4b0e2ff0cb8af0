//! `glmcheck logits TRACE [--reference TRACE]`: is this model's output information or noise —
//! entropy against ln V, top-1 probability and margin, logit spread, NaN/Inf, one token
//! repeated; against a reference, KL divergence, top-1 agreement and Δp.

use std::path::PathBuf;

use super::Outcome;
use crate::pipeline::logits::check;
use crate::report::logits::text;

#[derive(clap::Args, Debug)]
pub struct LogitsArgs {
    /// The trace whose `logits` stage to check (stored in full: `run`'s default).
    pub trace: PathBuf,
    /// A reference trace of the same prompt: KL divergence, top-1 agreement, Δp.
    #[arg(long, value_name = "TRACE")]
    pub reference: Option<PathBuf>,
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: LogitsArgs) -> anyhow::Result<Outcome> {
    let report = check(&args.trace, args.reference.as_deref())?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }
    Ok(report.verdict.into())
}
