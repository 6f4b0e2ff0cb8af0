//! `glmcheck logits`: a trace's logits judged on their own (information or noise), and against
//! a reference trace of the same prompt.

use std::path::Path;

use anyhow::bail;

use crate::compare::logits::{problems, LogitsComparison, LogitsHealth};
use crate::compare::stage_diff::whole_values;
use crate::compare::Status;
use crate::report::logits::{LogitsReport, ReferenceSide};
use crate::trace::Trace;

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

/// The logits of `trace`, and against those of `reference` where given.
pub fn check(trace: &Path, reference: Option<&Path>) -> anyhow::Result<LogitsReport> {
    let (logits, vocab) = logits_of(trace)?;
    let health = LogitsHealth::of(&logits, vocab);
    let reference = match reference {
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
            Some(ReferenceSide {
                comparison: LogitsComparison::of(&reference, &logits, vocab),
                health: LogitsHealth::of(&reference, vocab),
            })
        }
        None => None,
    };
    let problems = problems(&health, reference.as_ref().map(|r| &r.comparison));
    Ok(LogitsReport {
        verdict: if problems.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        },
        problems,
        health,
        reference,
    })
}
