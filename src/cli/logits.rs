//! `glmcheck logits TRACE [--reference TRACE]`: is this model's output information or noise —
//! entropy against ln V, top-1 probability and margin, logit spread, NaN/Inf, one token
//! repeated; against a reference, KL divergence, top-1 agreement and Δp.

use std::path::{Path, PathBuf};

use anyhow::bail;
use serde_json::json;

use super::Outcome;
use crate::compare::logits::{LogitsComparison, LogitsHealth};
use crate::compare::stage_diff::whole_values;
use crate::report::num;
use crate::report::terminal::table;
use crate::trace::Trace;

/// A candidate agreeing with its reference on fewer top-1 tokens than this fails.
const MIN_TOP1_AGREEMENT: f64 = 0.9;

/// The longest run of one top-1 token that still passes (the `$\ $\ $\` signature is longer).
const MAX_REPEAT: usize = 4;

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

/// The trace's logits `[positions, vocab]` and the vocabulary size.
fn logits_of(path: &Path) -> anyhow::Result<(Vec<f32>, usize)> {
    let trace = Trace::open(path)?;
    if !trace.stages().iter().any(|s| s.name == "logits") {
        bail!("{}: stage \"logits\": not in the trace", path.display());
    }
    let Some((values, shape)) = whole_values(&trace, "logits")? else {
        bail!(
            "{}: stage \"logits\": only statistics recorded (run with --full logits)",
            path.display()
        );
    };
    Ok((values, *shape.last().unwrap_or(&1) as usize))
}

pub fn run(args: LogitsArgs) -> anyhow::Result<Outcome> {
    let (logits, vocab) = logits_of(&args.trace)?;
    let health = LogitsHealth::of(&logits, vocab);
    let comparison = match &args.reference {
        Some(path) => {
            let (reference, ref_vocab) = logits_of(path)?;
            if ref_vocab != vocab || reference.len() != logits.len() {
                bail!(
                    "{}: logits of {} × {ref_vocab}, the candidate's are {} × {vocab}",
                    path.display(),
                    reference.len() / ref_vocab.max(1),
                    logits.len() / vocab.max(1)
                );
            }
            Some((
                LogitsComparison::of(&reference, &logits, vocab),
                LogitsHealth::of(&reference, vocab),
            ))
        }
        None => None,
    };
    let mut problems = Vec::new();
    if health.nan + health.inf > 0 {
        problems.push(format!("{} NaN and {} Inf logits", health.nan, health.inf));
    }
    if health.flat {
        problems.push(format!(
            "flat: mean entropy {:.3} of ln V = {:.3}",
            health.entropy_mean, health.ln_vocab
        ));
    }
    if health.longest_repeat > MAX_REPEAT {
        problems.push(format!(
            "one token is the top-1 at {} positions in a row",
            health.longest_repeat
        ));
    }
    if let Some((c, _)) = &comparison {
        if c.top1_agreement < MIN_TOP1_AGREEMENT {
            problems.push(format!(
                "top-1 agrees with the reference at {:.1}% of positions",
                100.0 * c.top1_agreement
            ));
        }
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "verdict": if problems.is_empty() { "pass" } else { "fail" },
                "problems": problems,
                "health": health,
                "reference": comparison.as_ref().map(|(c, h)| json!({"comparison": c, "health": h})),
            }))?
        );
    } else {
        print_text(&health, comparison.as_ref(), &problems);
    }
    Ok(if problems.is_empty() {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}

fn print_text(
    health: &LogitsHealth,
    comparison: Option<&(LogitsComparison, LogitsHealth)>,
    problems: &[String],
) {
    let mut t = table(&["", "candidate", "reference"]);
    let other = |f: &dyn Fn(&LogitsHealth) -> String| comparison.map_or("-".into(), |(_, h)| f(h));
    type Row<'a> = (&'a str, &'a dyn Fn(&LogitsHealth) -> String);
    let rows: [Row; 6] = [
        ("positions × vocab", &|h| {
            format!("{} × {}", h.positions, h.vocab)
        }),
        ("entropy mean / ln V", &|h| {
            format!("{:.3} / {:.3}", h.entropy_mean, h.ln_vocab)
        }),
        ("top-1 probability", &|h| format!("{:.4}", h.top1_prob_mean)),
        ("top-1 margin", &|h| num(h.margin_mean)),
        ("logit std", &|h| num(h.logit_std_mean)),
        ("longest top-1 repeat", &|h| h.longest_repeat.to_string()),
    ];
    for (name, f) in rows {
        t.add_row(vec![name.to_string(), f(health), other(f)]);
    }
    println!("{t}");
    if let Some((c, _)) = comparison {
        println!(
            "KL(reference ‖ candidate): mean {} p99 {} max {}; top-1 agreement {:.1}%; Δp mean {} min {}",
            num(c.kl_mean),
            num(c.kl_p99),
            num(c.kl_max),
            100.0 * c.top1_agreement,
            num(c.delta_p_mean),
            num(c.delta_p_min)
        );
    }
    if problems.is_empty() {
        println!("PASS: the logits carry information");
    } else {
        for p in problems {
            println!("FAIL: {p}");
        }
    }
}
