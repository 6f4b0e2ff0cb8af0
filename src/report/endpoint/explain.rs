//! `--explain`'s part of the report: the hypotheses ranked by fit, the verdict and its rule.

use std::fmt::Write;

use serde::Serialize;

use super::super::num;
use super::super::terminal::table;

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

/// `--explain`'s part of the terminal text: the ranking with each run's cost, then the verdict.
pub(super) fn explanation_text(out: &mut String, e: &Explanation) {
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
