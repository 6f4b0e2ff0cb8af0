//! `glmcheck endpoint`'s report: a running server's top-k log-probabilities against the
//! reference forward, prompt by prompt, as JSON or terminal text. No prompt text and no logits
//! are in it: prompts are counted in tokens, positions named by index, tokens by id.

use std::fmt::Write;

use serde::Serialize;

use super::terminal::table;
use super::{num, sorted_keys, verdict_word};
use crate::compare::top_k::{ServerHealth, TopKComparison};
use crate::compare::Status;

/// The positions shown around the first parting in the terminal text.
const SHOWN_POSITIONS: usize = 8;

/// A server judged against the reference on one or more prompts.
#[derive(Clone, Debug, Serialize)]
pub struct EndpointReport {
    /// Generated tokens asked for per prompt (a greedy continuation).
    pub max_tokens: u32,
    /// The local checkpoint the reference ran.
    pub model: String,
    /// Every prompt's problems, each prefixed with its prompt's number.
    pub problems: Vec<String>,
    pub prompts: Vec<PromptCheck>,
    /// The model's name as the server lists it (`/v1/models`).
    pub served_model: String,
    /// The log-probabilities asked for at each position.
    pub top_k: u32,
    pub url: String,
    pub verdict: Status,
    /// `--explain`: which catalogued fault best explains the server's answer.
    pub explanation: Option<Explanation>,
}

/// One prompt: the server's answer against the reference's forward on the same token ids.
#[derive(Clone, Debug, Serialize)]
pub struct PromptCheck {
    #[serde(serialize_with = "sorted_keys")]
    pub comparison: TopKComparison,
    /// The server's greedy continuation (token ids).
    pub continuation: Vec<u32>,
    /// The first generated token where the server's continuation differs from the reference's.
    pub continuation_differs_at: Option<usize>,
    #[serde(serialize_with = "sorted_keys")]
    pub health: ServerHealth,
    /// The prompt's number, from 1, in the order given.
    pub index: usize,
    pub problems: Vec<String>,
    /// The reference's greedy continuation (token ids).
    pub reference_continuation: Vec<u32>,
    /// The reference forward's wall time.
    pub reference_seconds: f64,
    /// The server's answer's wall time.
    pub server_seconds: f64,
    /// The prompt's length in tokens.
    pub tokens: usize,
    pub verdict: Status,
}

/// The share of the clean model's score the best hypothesis must stay below to explain the
/// server: it must fit the server at least twice as well as the model without a fault.
pub const EXPLAINS_VS_CLEAN: f64 = 0.5;

/// The share of the runner-up's score the best hypothesis must stay below: a margin, so that
/// one fault is named only where no other fits nearly as well.
pub const EXPLAINS_VS_RUNNER_UP: f64 = 0.5;

/// The rule of [`ExplainVerdict`], in words, as the report states it.
pub const EXPLAIN_RULE: &str = "a fault explains the server when its score is below 0.5 × the clean model's and below 0.5 × the runner-up's; score: the mean over positions and the server's listed tokens of |logprob_hypothesis − logprob_server| (nats, each term capped at 30)";

/// One hypothesis run and scored.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Hypothesis {
    /// `clean`, or the fault as `--inject` takes it (`unsharded-column=kv_b`).
    pub name: String,
    /// Its fit to the server (`compare::top_k::fit`): lower is better, 0 a perfect fit.
    pub score: f64,
    /// The run's wall time, every prompt's forward together.
    pub seconds: f64,
}

/// What `--explain` concluded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExplainVerdict {
    /// The server agrees with the reference: no hypothesis was run.
    NothingToExplain,
    /// The best fault is below [`EXPLAINS_VS_CLEAN`] × clean and [`EXPLAINS_VS_RUNNER_UP`] ×
    /// the runner-up.
    Explained,
    /// The best fault beats clean, but the runner-up fits nearly as well: no single fault.
    Ambiguous,
    /// No catalogued fault fits clearly better than the model without a fault.
    Unexplained,
}

/// `--explain`: every catalogued fault that can exist at the server's TP and dtype, planted in
/// the reference in turn, scored by how well it reproduces the server's log-probabilities.
#[derive(Clone, Debug, Serialize)]
pub struct Explanation {
    pub tp: u64,
    pub dtype: &'static str,
    /// The most runs allowed (`--budget`, the clean one included); `None`: all.
    pub budget: Option<usize>,
    /// Every hypothesis run, the best fit first (ties in the order they ran).
    pub ranking: Vec<Hypothesis>,
    pub best: Option<Hypothesis>,
    pub runner_up: Option<Hypothesis>,
    /// The model without a fault: the baseline.
    pub clean_score: Option<f64>,
    pub verdict: ExplainVerdict,
    /// The verdict in a sentence.
    pub conclusion: String,
    pub rule: &'static str,
    /// Catalogued faults not tried, and why (TP, dtype, the model, the budget).
    pub not_tried: Vec<String>,
    /// Hypotheses whose run failed, with the error.
    pub failed: Vec<String>,
    /// Every run's wall time together.
    pub seconds: f64,
}

impl Explanation {
    /// The verdict on a ranking (best first) holding `clean`.
    pub fn judge(ranking: &[Hypothesis]) -> (ExplainVerdict, String) {
        let clean = ranking.iter().find(|h| h.name == "clean");
        let (Some(best), Some(clean)) = (ranking.first(), clean) else {
            return (
                ExplainVerdict::Unexplained,
                "no catalogued fault explains it: nothing was scored against the clean model"
                    .into(),
            );
        };
        if best.name == "clean" {
            return (
                ExplainVerdict::Unexplained,
                format!(
                    "no catalogued fault explains it: the clean model fits best ({}){}",
                    num(clean.score),
                    ranking.get(1).map_or(String::new(), |h| format!(
                        ", the closest fault is {} ({})",
                        h.name,
                        num(h.score)
                    ))
                ),
            );
        }
        if best.score >= EXPLAINS_VS_CLEAN * clean.score {
            return (
                ExplainVerdict::Unexplained,
                format!(
                    "no catalogued fault explains it: the best, {} ({}), is not below {EXPLAINS_VS_CLEAN} × the clean model's {}",
                    best.name,
                    num(best.score),
                    num(clean.score)
                ),
            );
        }
        match ranking.get(1) {
            Some(second) if best.score >= EXPLAINS_VS_RUNNER_UP * second.score => (
                ExplainVerdict::Ambiguous,
                format!(
                    "no single catalogued fault explains it: {} ({}) and {} ({}) fit nearly as well (the best is not below {EXPLAINS_VS_RUNNER_UP} × the runner-up)",
                    best.name,
                    num(best.score),
                    second.name,
                    num(second.score)
                ),
            ),
            _ => (
                ExplainVerdict::Explained,
                format!(
                    "{} explains it: {} against the clean model's {}",
                    best.name,
                    num(best.score),
                    num(clean.score)
                ),
            ),
        }
    }
}

/// The report for a terminal: per prompt the comparison's summary, the positions from the
/// first parting, then PASS or each problem.
pub fn text(r: &EndpointReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} (serving {}) against the reference on {}: top-{} log-probabilities at every prompt position",
        r.url, r.served_model, r.model, r.top_k
    );
    for p in &r.prompts {
        let c = &p.comparison;
        let h = &p.health;
        let _ = writeln!(
            out,
            "\nprompt {}: {} tokens, server {:.2} s, reference {:.2} s — {}",
            p.index,
            p.tokens,
            p.server_seconds,
            p.reference_seconds,
            verdict_word(p.verdict)
        );
        let mut t = table(&["", "value"]);
        let rows = [
            (
                "KL(reference ‖ server), top-k + rest".to_string(),
                format!("mean {} max {}", num(c.kl_mean), num(c.kl_max)),
            ),
            (
                "top-1 agreement".into(),
                format!("{:.1}%", 100.0 * c.top1_agreement),
            ),
            (
                "Δp of the reference's top-1".into(),
                format!("mean {} min {}", num(c.delta_p_mean), num(c.delta_p_min)),
            ),
            (
                "max |Δ logprob| (shared tokens)".into(),
                format!(
                    "{} (tolerance {})",
                    num(c.max_abs_delta_logprob),
                    c.tolerance
                ),
            ),
            (
                "first parting".into(),
                match &c.first_parting {
                    Some(part) => format!(
                        "position {} of {}: {} ({} positions part)",
                        part.position, c.positions, part.reason, c.parted
                    ),
                    None => format!("none of {} positions", c.positions),
                },
            ),
            (
                "top-1 probability: server / reference".into(),
                format!(
                    "{:.4} / {:.4} (1/V = {})",
                    h.top1_prob_mean,
                    h.reference_top1_prob_mean,
                    num(h.uniform)
                ),
            ),
            (
                "continuation: server / reference".into(),
                format!(
                    "{} / {}{}",
                    ids(&p.continuation),
                    ids(&p.reference_continuation),
                    p.continuation_differs_at
                        .map_or(String::new(), |i| format!(" (differ from token {i})"))
                ),
            ),
        ];
        for (name, value) in rows {
            t.add_row(vec![name, value]);
        }
        let _ = writeln!(out, "{t}");
        if let Some(part) = &c.first_parting {
            let mut t = table(&[
                "position",
                "top-1 ref",
                "top-1 server",
                "KL",
                "Δp",
                "max |Δ logprob|",
            ]);
            for d in c
                .per_position
                .iter()
                .skip(part.position)
                .take(SHOWN_POSITIONS)
            {
                t.add_row(vec![
                    d.position.to_string(),
                    d.reference_top1.to_string(),
                    d.server_top1.to_string(),
                    num(d.kl),
                    num(d.delta_p),
                    num(d.max_abs_delta_logprob),
                ]);
            }
            let _ = writeln!(out, "{t}");
        }
    }
    let _ = writeln!(out);
    if r.problems.is_empty() {
        let _ = writeln!(out, "PASS: the server agrees with the reference");
    } else {
        for p in &r.problems {
            let _ = writeln!(out, "FAIL: {p}");
        }
    }
    if let Some(e) = &r.explanation {
        explanation_text(&mut out, e);
    }
    out
}

/// `--explain`'s part of the terminal text: the ranking with each run's cost, then the verdict.
fn explanation_text(out: &mut String, e: &Explanation) {
    let _ = writeln!(
        out,
        "\nexplain (TP {}, {}): {} runs, {:.2} s",
        e.tp,
        e.dtype,
        e.ranking.len(),
        e.seconds
    );
    if !e.ranking.is_empty() {
        let mut t = table(&["rank", "hypothesis", "score (nats)", "seconds"]);
        for (i, h) in e.ranking.iter().enumerate() {
            t.add_row(vec![
                (i + 1).to_string(),
                h.name.clone(),
                num(h.score),
                format!("{:.2}", h.seconds),
            ]);
        }
        let _ = writeln!(out, "{t}");
    }
    for note in e.not_tried.iter().chain(&e.failed) {
        let _ = writeln!(out, "note: {note}");
    }
    if e.verdict != ExplainVerdict::NothingToExplain {
        let _ = writeln!(out, "rule: {}", e.rule);
    }
    let _ = writeln!(out, "EXPLAIN: {}", e.conclusion);
}

fn ids(tokens: &[u32]) -> String {
    if tokens.is_empty() {
        return "-".into();
    }
    tokens
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranked(scores: &[(&str, f64)]) -> Vec<Hypothesis> {
        scores
            .iter()
            .map(|&(name, score)| Hypothesis {
                name: name.into(),
                score,
                seconds: 0.1,
            })
            .collect()
    }

    #[test]
    fn a_fault_explains_only_far_below_clean_and_the_runner_up() {
        let judge = |s: &[(&str, f64)]| Explanation::judge(&ranked(s)).0;
        use ExplainVerdict::*;
        assert_eq!(
            judge(&[("rope-neox", 0.01), ("clean", 0.8), ("x", 0.9)]),
            Explained
        );
        assert_eq!(
            judge(&[("rope-neox", 0.01), ("x", 0.015), ("clean", 0.8)]),
            Ambiguous
        );
        assert_eq!(judge(&[("rope-neox", 0.5), ("clean", 0.8)]), Unexplained);
        assert_eq!(judge(&[("clean", 0.5), ("rope-neox", 0.6)]), Unexplained);
        assert_eq!(judge(&[("rope-neox", 0.0)]), Unexplained);
        let (_, words) = Explanation::judge(&ranked(&[("clean", 0.5), ("rope-neox", 0.6)]));
        assert!(
            words.starts_with("no catalogued fault explains it: the clean model fits best"),
            "{words}"
        );
    }
}
