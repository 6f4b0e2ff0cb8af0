//! `--concurrency`'s part of the report: each prompt asked alone and again beside other
//! requests, and how far its log-probabilities moved.

use std::fmt::Write;

use serde::Serialize;

use super::super::num;
use super::super::terminal::table;
use crate::compare::server_drift::Drift;
use crate::compare::{FaultClass, Status};

/// Every prompt asked again while other requests ran beside it.
#[derive(Clone, Debug, Serialize)]
pub struct ConcurrencyCheck {
    /// The class a failure carries: `concurrency_dependence`.
    pub class: FaultClass,
    /// Requests of glmcheck's own sent beside each prompt, all released together.
    pub beside: usize,
    /// Times each prompt was asked beside others; the largest move counts.
    pub rounds: usize,
    /// The largest move (nats) a listed token's log-probability may make.
    pub tolerance: f64,
    pub prompts: Vec<PromptDrift>,
    /// Prompts whose log-probabilities moved beyond the tolerance, in words.
    pub problems: Vec<String>,
    pub verdict: Status,
}

/// One prompt: alone against beside others, its largest move over the rounds.
#[derive(Clone, Debug, Serialize)]
pub struct PromptDrift {
    /// The prompt's number, from 1, as in the report's `prompts`.
    pub index: usize,
    /// The round (from 1) whose move was the largest.
    pub round: usize,
    pub drift: Drift,
    /// The first generated token where the continuation beside others differs from the one
    /// alone (a near tie can flip it without any fault; the drift says whether it is one).
    pub continuation_differs_at: Option<usize>,
    /// The slowest answer beside others, in seconds (the one alone is the prompt's
    /// `server_seconds`).
    pub seconds: f64,
}

impl ConcurrencyCheck {
    /// The check from every prompt's largest move, judged against `tolerance`.
    pub fn judge(beside: usize, rounds: usize, tolerance: f64, prompts: Vec<PromptDrift>) -> Self {
        let problems: Vec<String> = prompts
            .iter()
            .filter(|p| p.drift.max_abs_delta_logprob > tolerance)
            .map(|p| problem(p, beside, tolerance))
            .collect();
        ConcurrencyCheck {
            class: FaultClass::ConcurrencyDependence,
            beside,
            rounds,
            tolerance,
            verdict: if problems.is_empty() {
                Status::Pass
            } else {
                Status::Fail
            },
            problems,
            prompts,
        }
    }
}

/// A prompt that moved, in one line: where, which token, by how much.
fn problem(p: &PromptDrift, beside: usize, tolerance: f64) -> String {
    let d = &p.drift;
    let at = d.at.as_ref().map_or(String::new(), |a| {
        format!(
            " at position {}: token {} has log-probability {} alone, {} beside them",
            a.position,
            a.token,
            num(a.alone),
            num(a.beside_others)
        )
    });
    format!(
        "prompt {}: concurrency_dependence: beside {beside} other requests its log-probabilities move by {} nats (tolerance {tolerance}){at}; {} of {} positions change their top-1",
        p.index,
        num(d.max_abs_delta_logprob),
        d.top1_changed.len(),
        d.positions
    )
}

/// The terminal text: one row per prompt (its problems are among the report's).
pub(super) fn concurrency_text(out: &mut String, c: &ConcurrencyCheck) {
    let _ = writeln!(
        out,
        "\nconcurrency: each prompt asked {} time(s) beside {} other requests, against its answer alone",
        c.rounds, c.beside
    );
    let mut t = table(&[
        "prompt",
        "max |Δ logprob|",
        "where",
        "top-1 changed",
        "continuation differs",
        "seconds",
    ]);
    for p in &c.prompts {
        let d = &p.drift;
        t.add_row(vec![
            p.index.to_string(),
            num(d.max_abs_delta_logprob),
            d.at.as_ref().map_or("-".into(), |a| {
                format!("position {}, token {}", a.position, a.token)
            }),
            format!("{} of {}", d.top1_changed.len(), d.positions),
            p.continuation_differs_at
                .map_or("no".into(), |i| format!("from token {i}")),
            format!("{:.2}", p.seconds),
        ]);
    }
    let _ = writeln!(out, "{t}");
}
