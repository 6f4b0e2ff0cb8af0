//! `glmcheck gate`'s verdict for people and CI systems: terminal text ([`text`]), JUnit XML
//! ([`junit`]) and Markdown ([`markdown`]) from one [`GateReport`]; and what `--update` wrote
//! ([`Updated`]).

pub mod junit;
pub mod markdown;

use std::fmt::Write;
use std::path::PathBuf;

use serde::Serialize;

use super::num;
use super::terminal::table;
use crate::compare::Status;
use crate::gate::check::{Basis, GateReport};
use crate::gate::Baseline;

/// A baseline written from a candidate (`--update`).
#[derive(Clone, Debug, Serialize)]
pub struct Updated {
    pub dtype: String,
    pub epsilon: f64,
    pub fingerprint: String,
    /// Stage records the baseline holds.
    pub stages: usize,
    pub tp: u32,
    /// The baseline file.
    pub updated: PathBuf,
}

impl Updated {
    pub fn new(path: PathBuf, made: &Baseline) -> Updated {
        Updated {
            dtype: made.dtype.clone(),
            epsilon: made.limits.epsilon,
            fingerprint: made.model.fingerprint.clone(),
            stages: made.stages.len(),
            tp: made.tp,
            updated: path,
        }
    }

    /// One line for the terminal.
    pub fn text(&self) -> String {
        format!(
            "wrote {}: {} stage records, {} at TP {}, ε = {:.3e}\n",
            self.updated.display(),
            self.stages,
            self.dtype,
            self.tp,
            self.epsilon
        )
    }
}

/// The verdict in one word: a partial candidate whose stages held is `PARTIAL`, never a pass.
fn headline(r: &GateReport) -> &'static str {
    match (r.verdict, r.regressed()) {
        (Status::Pass, _) => "PASS",
        (Status::Fail, true) => "REGRESSION",
        (Status::Fail, false) => "PARTIAL",
    }
}

/// A float with the digits that tell baseline and candidate apart.
fn full(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.9e}"))
}

/// The verdict, the broken checks (or the stages nearest their limits) and the notes.
pub fn text(r: &GateReport) -> String {
    let mut out = String::new();
    let identical = r
        .stages
        .iter()
        .filter(|s| s.basis == Basis::Identical)
        .count();
    let _ = writeln!(
        out,
        "{}: {} against {} ({}, TP {}, ε = {:.3e}): {} of {} checks broke; {identical} stage records bit-identical",
        headline(r),
        r.candidate,
        r.baseline,
        r.dtype,
        r.tp,
        r.epsilon,
        r.failed,
        r.checked
    );
    if r.failed > 0 {
        let mut t = table(&["stage", "check", "baseline", "candidate", "limit", "why"]);
        for s in r.failures() {
            for f in &s.failures {
                t.add_row(vec![
                    s.label(),
                    f.check.clone(),
                    full(f.baseline),
                    full(f.candidate),
                    f.limit.map_or("-".into(), num),
                    f.why.clone(),
                ]);
            }
        }
        let _ = writeln!(out, "{t}");
        if let Some(first) = r.failures().next() {
            let _ = writeln!(out, "first broken stage: {}", first.label());
        }
    } else {
        // How close the candidate came: the stages nearest their limits.
        let mut near: Vec<_> = r.stages.iter().filter(|s| s.headroom_used > 0.0).collect();
        near.sort_by(|a, b| b.headroom_used.total_cmp(&a.headroom_used));
        if !near.is_empty() {
            let mut t = table(&["stage", "closest check", "share of its limit used"]);
            for s in near.iter().take(5) {
                t.add_row(vec![
                    s.label(),
                    s.closest.clone().unwrap_or_default(),
                    format!("{:.1}%", 100.0 * s.headroom_used),
                ]);
            }
            let _ = writeln!(out, "{t}");
        }
    }
    for n in &r.notes {
        let _ = writeln!(out, "note: {n}");
    }
    if r.extra_stages > 0 {
        let _ = writeln!(
            out,
            "note: the candidate records {} stage records the baseline does not (not judged)",
            r.extra_stages
        );
    }
    out
}
