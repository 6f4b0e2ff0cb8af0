//! `glmcheck logits`'s report: the logits' health, against a reference where given, and what
//! makes them garbage; as JSON or a terminal table.

use std::fmt::Write;

use serde::Serialize;

use super::terminal::table;
use super::{num, sorted_keys};
use crate::compare::logits::{LogitsComparison, LogitsHealth};
use crate::compare::Status;

/// One trace's logits judged.
#[derive(Clone, Debug, Serialize)]
pub struct LogitsReport {
    #[serde(serialize_with = "sorted_keys")]
    pub health: LogitsHealth,
    /// Why the logits fail, in words; empty when they pass.
    pub problems: Vec<String>,
    pub reference: Option<ReferenceSide>,
    pub verdict: Status,
}

/// The reference's logits: the candidate's against them, and their own health.
#[derive(Clone, Debug, Serialize)]
pub struct ReferenceSide {
    #[serde(serialize_with = "sorted_keys")]
    pub comparison: LogitsComparison,
    #[serde(serialize_with = "sorted_keys")]
    pub health: LogitsHealth,
}

/// The health of both sides side by side, the comparison, and PASS or each problem.
pub fn text(r: &LogitsReport) -> String {
    let mut out = String::new();
    let mut t = table(&["", "candidate", "reference"]);
    let other = |f: &dyn Fn(&LogitsHealth) -> String| {
        r.reference
            .as_ref()
            .map_or("-".into(), |side| f(&side.health))
    };
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
        t.add_row(vec![name.to_string(), f(&r.health), other(f)]);
    }
    let _ = writeln!(out, "{t}");
    if let Some(side) = &r.reference {
        let c = &side.comparison;
        let _ = writeln!(
            out,
            "KL(reference ‖ candidate): mean {} p99 {} max {}; top-1 agreement {:.1}%; Δp mean {} min {}",
            num(c.kl_mean),
            num(c.kl_p99),
            num(c.kl_max),
            100.0 * c.top1_agreement,
            num(c.delta_p_mean),
            num(c.delta_p_min)
        );
    }
    if r.problems.is_empty() {
        let _ = writeln!(out, "PASS: the logits carry information");
    } else {
        for p in &r.problems {
            let _ = writeln!(out, "FAIL: {p}");
        }
    }
    out
}
