//! `glmcheck endpoint`'s report: a running server's top-k log-probabilities against the
//! reference forward, prompt by prompt, as JSON or terminal text. No prompt text and no logits
//! are in it: prompts are counted in tokens, positions named by index, tokens by id.

use std::fmt::Write;

use serde::Serialize;

use super::terminal::table;
use super::{num, sorted_keys, verdict_word};
use crate::compare::top_k::{ServerHealth, TopKComparison};
use crate::compare::Status;
use crate::endpoint::Api;

mod concurrency;
mod explain;
mod html;
mod markdown;

use concurrency::concurrency_text;
pub use concurrency::{ConcurrencyCheck, PromptDrift};
use explain::explanation_text;
pub use explain::{
    ExplainVerdict, Explanation, Hypothesis, EXPLAINS_VS_CLEAN, EXPLAINS_VS_RUNNER_UP, EXPLAIN_RULE,
};
pub use html::html;
pub use markdown::markdown;

/// The positions shown around the first parting in the terminal text.
const SHOWN_POSITIONS: usize = 8;

/// A server judged against the reference on one or more prompts.
#[derive(Clone, Debug, Serialize)]
pub struct EndpointReport {
    /// The API the server was asked through (`openai`: vLLM's `prompt_logprobs`;
    /// `llama-server`: one `/completion` per prompt position).
    pub api: Api,
    /// Generated tokens asked for per prompt (a greedy continuation).
    pub max_tokens: u32,
    /// The local checkpoint the reference ran.
    pub model: String,
    /// Every prompt's problems (against the reference, then beside other requests), each
    /// prefixed with its prompt's number.
    pub problems: Vec<String>,
    pub prompts: Vec<PromptCheck>,
    /// The model's name as the server lists it (`/v1/models`).
    pub served_model: String,
    /// The log-probabilities asked for at each position.
    pub top_k: u32,
    /// The log-probabilities the server gave at each position: `top_k`, or fewer where the
    /// server caps them (vLLM's `--max-logprobs`) and was asked again at its cap.
    pub top_k_served: u32,
    pub url: String,
    pub verdict: Status,
    /// `--explain`: which catalogued fault best explains the server's answer.
    pub explanation: Option<Explanation>,
    /// `--concurrency`: the same prompts asked again beside other requests.
    pub concurrency: Option<ConcurrencyCheck>,
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

/// The report for a terminal: per prompt the comparison's summary, the positions from the
/// first parting, then PASS or each problem.
pub fn text(r: &EndpointReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} ({}, serving {}) against the reference on {}: top-{} log-probabilities at every prompt position",
        r.url,
        match r.api {
            Api::OpenAi => "OpenAI API",
            Api::LlamaServer => "llama-server",
        },
        r.served_model,
        r.model,
        r.top_k_served
    );
    if r.top_k_served < r.top_k {
        let _ = writeln!(
            out,
            "note: the server gives at most {} log-probabilities per position (--top-k {} asked)",
            r.top_k_served, r.top_k
        );
    }
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
            ("continuation: server / reference".into(), continuations(p)),
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
    if let Some(c) = &r.concurrency {
        concurrency_text(&mut out, c);
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

/// The server's and the reference's continuations as ids, and where they differ.
fn continuations(p: &PromptCheck) -> String {
    format!(
        "{} / {}{}",
        ids(&p.continuation),
        ids(&p.reference_continuation),
        p.continuation_differs_at
            .map_or(String::new(), |i| format!(" (differ from token {i})"))
    )
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
