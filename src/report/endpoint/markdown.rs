//! `glmcheck endpoint --markdown`: the report as GitHub-flavoured Markdown, short enough for a
//! CI job summary. The verdict with what was asked, per prompt the comparison in one table row
//! and the first few positions from the first parting, the concurrency table, the explanation's
//! ranking (folded when long) and the problems. Every string that comes from outside (the URL,
//! the model names, the server's numbers in words) goes through `report::markdown::text`: a
//! served model named `<script>` or `**x**` is shown, never rendered.

use std::fmt::Write;

use super::{ids, ConcurrencyCheck, EndpointReport, ExplainVerdict, Explanation, PromptCheck};
use crate::compare::Status;
use crate::endpoint::Api;
use crate::report::markdown::{code, text};
use crate::report::{num, verdict_word};

/// Positions listed from the first parting: enough to see whether it spreads, few enough for a
/// job summary (the terminal text shows more).
const POSITION_ROWS: usize = 5;

/// Rankings longer than this are folded into a `<details>` block: `--explain` at TP 2 runs
/// dozens of hypotheses, and the conclusion already names the best.
const FOLD_RANKING: usize = 8;

/// The API in words, as the reports name it.
pub(super) fn api_words(api: Api) -> &'static str {
    match api {
        Api::OpenAi => "OpenAI API",
        Api::LlamaServer => "llama-server",
    }
}

/// The tolerance the prompts were judged by (one for the whole run); `None` without a prompt.
pub(super) fn tolerance(r: &EndpointReport) -> Option<f64> {
    r.prompts.first().map(|p| p.comparison.tolerance)
}

/// ✅ or ❌.
fn icon(s: Status) -> &'static str {
    match s {
        Status::Pass => "✅",
        Status::Fail => "❌",
    }
}

/// The report as Markdown.
pub fn markdown(r: &EndpointReport) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "### {} glmcheck endpoint: **{}**\n",
        icon(r.verdict),
        verdict_word(r.verdict)
    );
    let _ = write!(
        md,
        "{} ({}, serving {}) against the reference on {} · top-{} log-probabilities at every \
         prompt position",
        text(&r.url),
        api_words(r.api),
        text(&r.served_model),
        text(&r.model),
        r.top_k_served
    );
    if let Some(t) = tolerance(r) {
        let _ = write!(md, " · tolerance {t} nats");
    }
    md.push_str("\n\n");
    for p in &r.prompts {
        prompt(&mut md, p);
    }
    if let Some(c) = &r.concurrency {
        concurrency(&mut md, c);
    }
    if let Some(e) = &r.explanation {
        explanation(&mut md, e);
    }
    if r.problems.is_empty() {
        md.push_str("**PASS:** the server agrees with the reference\n");
    } else {
        md.push_str("#### Problems\n\n");
        for p in &r.problems {
            let _ = writeln!(md, "- {}", text(p));
        }
    }
    md
}

fn prompt(md: &mut String, p: &PromptCheck) {
    let c = &p.comparison;
    let h = &p.health;
    let _ = writeln!(
        md,
        "#### {} Prompt {}: {} tokens — {}\n",
        icon(p.verdict),
        p.index,
        p.tokens,
        verdict_word(p.verdict)
    );
    let _ = write!(
        md,
        "server {:.2} s · reference {:.2} s · top-1 probability: server {:.4} / reference {:.4} \
         (1/V = {}) · continuation: server {} / reference {}",
        p.server_seconds,
        p.reference_seconds,
        h.top1_prob_mean,
        h.reference_top1_prob_mean,
        num(h.uniform),
        ids(&p.continuation),
        ids(&p.reference_continuation)
    );
    if let Some(i) = p.continuation_differs_at {
        let _ = write!(md, " (differ from token {i})");
    }
    if h.flat {
        md.push_str(" · **flat**");
    }
    if h.non_finite > 0 {
        let _ = write!(md, " · **{} non-finite log-probabilities**", h.non_finite);
    }
    md.push_str("\n\n");
    md.push_str(
        "| KL mean | KL max | top-1 agreement | Δp mean | Δp min | max \\|Δ logprob\\| | first \
         parting |\n|---:|---:|---:|---:|---:|---:|---|\n",
    );
    let _ = writeln!(
        md,
        "| {} | {} | {:.1} % | {} | {} | {} | {} |\n",
        num(c.kl_mean),
        num(c.kl_max),
        100.0 * c.top1_agreement,
        num(c.delta_p_mean),
        num(c.delta_p_min),
        num(c.max_abs_delta_logprob),
        match &c.first_parting {
            Some(part) => format!(
                "position {} of {} ({} part)",
                part.position, c.positions, c.parted
            ),
            None => format!("none of {} positions", c.positions),
        }
    );
    let Some(part) = &c.first_parting else {
        return;
    };
    let _ = writeln!(
        md,
        "**First parting:** position {}: {}\n",
        part.position,
        text(&part.reason)
    );
    md.push_str(
        "| position | top-1 ref | top-1 server | KL | Δp | max \\|Δ logprob\\| |\n\
         |---:|---:|---:|---:|---:|---:|\n",
    );
    let from = c
        .per_position
        .iter()
        .position(|d| d.position == part.position)
        .unwrap_or(c.per_position.len());
    for d in c.per_position.iter().skip(from).take(POSITION_ROWS) {
        let beyond = if d.max_abs_delta_logprob > c.tolerance {
            "**"
        } else {
            ""
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {beyond}{}{beyond} |",
            d.position,
            d.reference_top1,
            d.server_top1,
            num(d.kl),
            num(d.delta_p),
            num(d.max_abs_delta_logprob)
        );
    }
    let rest = c.per_position.len().saturating_sub(from + POSITION_ROWS);
    if rest > 0 {
        let _ = writeln!(md, "\n… and {rest} more positions.");
    }
    md.push('\n');
}

fn concurrency(md: &mut String, c: &ConcurrencyCheck) {
    let _ = writeln!(
        md,
        "#### {} Concurrency — {}\n\nEach prompt asked {} time(s) beside {} other requests, \
         against its answer alone (tolerance {} nats).\n",
        icon(c.verdict),
        verdict_word(c.verdict),
        c.rounds,
        c.beside,
        c.tolerance
    );
    md.push_str(
        "| prompt | max \\|Δ logprob\\| | where | top-1 changed | continuation differs | seconds \
         |\n|---:|---:|---|---:|---|---:|\n",
    );
    for p in &c.prompts {
        let d = &p.drift;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} of {} | {} | {:.2} |",
            p.index,
            num(d.max_abs_delta_logprob),
            d.at.as_ref().map_or("-".into(), |a| format!(
                "position {}, token {}",
                a.position, a.token
            )),
            d.top1_changed.len(),
            d.positions,
            p.continuation_differs_at
                .map_or("no".into(), |i| format!("from token {i}")),
            p.seconds
        );
    }
    md.push('\n');
}

/// The explanation's verdict in words.
pub(super) fn explain_words(v: ExplainVerdict) -> &'static str {
    match v {
        ExplainVerdict::NothingToExplain => "nothing to explain",
        ExplainVerdict::Explained => "explained",
        ExplainVerdict::Ambiguous => "ambiguous",
        ExplainVerdict::Unexplained => "unexplained",
    }
}

fn explanation(md: &mut String, e: &Explanation) {
    let _ = writeln!(
        md,
        "#### Explain (TP {}, {}): {} runs, {:.2} s\n\n**Verdict: {}** — {}\n",
        e.tp,
        text(e.dtype),
        e.ranking.len(),
        e.seconds,
        explain_words(e.verdict),
        text(&e.conclusion)
    );
    if !e.ranking.is_empty() {
        let fold = e.ranking.len() > FOLD_RANKING;
        if fold {
            let _ = writeln!(
                md,
                "<details><summary>Ranking: {} hypotheses, the best fit first</summary>\n",
                e.ranking.len()
            );
        }
        md.push_str("| rank | hypothesis | score (nats) | seconds |\n|---:|---|---:|---:|\n");
        for (i, h) in e.ranking.iter().enumerate() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.2} |",
                i + 1,
                code(&h.name),
                num(h.score),
                h.seconds
            );
        }
        md.push('\n');
        if fold {
            md.push_str("</details>\n\n");
        }
    }
    for note in e.not_tried.iter().chain(&e.failed) {
        let _ = writeln!(md, "- note: {}", text(note));
    }
    if !(e.not_tried.is_empty() && e.failed.is_empty()) {
        md.push('\n');
    }
    if e.verdict != ExplainVerdict::NothingToExplain {
        let _ = writeln!(md, "*Rule:* {}\n", text(e.rule));
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::compare::server_drift::{Drift, DriftAt};
    use crate::compare::top_k::{Parting, PositionDiff, ServerHealth, TopKComparison};
    use crate::report::endpoint::{Hypothesis, PromptDrift, EXPLAIN_RULE};

    /// A server that parts from the reference at position 2 of 12, answers otherwise beside
    /// other requests, and whose answer `rope-neox` explains, serving `served`; 12 hypotheses
    /// ranked, so that the Markdown folds them.
    pub(in super::super) fn failing_report(served: &str) -> EndpointReport {
        let per_position: Vec<PositionDiff> = (0..12)
            .map(|i| PositionDiff {
                position: i,
                reference_top1: 7,
                server_top1: if i == 3 { 9 } else { 7 },
                kl: if i < 2 { 0.0 } else { 1e-3 * i as f64 },
                delta_p: -0.01,
                max_abs_delta_logprob: if i < 2 { 1e-6 } else { 0.8 + 0.1 * i as f64 },
                reference_mass: 0.99,
            })
            .collect();
        let comparison = TopKComparison {
            positions: 12,
            tolerance: 0.5,
            kl_mean: 4e-3,
            kl_max: 1.1e-2,
            top1_agreement: 11.0 / 12.0,
            delta_p_mean: -0.01,
            delta_p_min: -0.01,
            max_abs_delta_logprob: 1.9,
            parted: 10,
            first_parting: Some(Parting {
                position: 2,
                reason: "|Δ logprob| 1.000 beyond the tolerance 0.5".into(),
            }),
            per_position,
        };
        let health = ServerHealth {
            uniform: 1.0 / 384.0,
            top1_prob_mean: 0.9,
            reference_top1_prob_mean: 0.95,
            flat: false,
            non_finite: 0,
            longest_repeat: 1,
            reference_longest_repeat: 1,
        };
        let mut ranking = vec![
            Hypothesis {
                name: "rope-neox".into(),
                score: 2e-6,
                seconds: 0.02,
            },
            Hypothesis {
                name: "clean".into(),
                score: 0.7,
                seconds: 0.3,
            },
        ];
        ranking.extend((0..10).map(|i| Hypothesis {
            name: format!("rank-order=w{i}"),
            score: 0.8 + 0.1 * i as f64,
            seconds: 0.02,
        }));
        let (verdict, conclusion) = Explanation::judge(&ranking);
        let explanation = Explanation {
            tp: 2,
            dtype: "f32",
            budget: None,
            best: ranking.first().cloned(),
            runner_up: ranking.get(1).cloned(),
            clean_score: Some(0.7),
            verdict,
            conclusion,
            rule: EXPLAIN_RULE,
            not_tried: vec!["fp16-overflow not tried: needs --dtype f16".into()],
            failed: vec![],
            seconds: 0.5,
            ranking,
        };
        let concurrency = ConcurrencyCheck::judge(
            3,
            2,
            0.5,
            vec![PromptDrift {
                index: 1,
                round: 2,
                drift: Drift {
                    max_abs_delta_logprob: 1.25,
                    at: Some(DriftAt {
                        position: 4,
                        token: 11,
                        alone: -0.5,
                        beside_others: -1.75,
                    }),
                    top1_changed: vec![4],
                    positions: 12,
                },
                continuation_differs_at: None,
                seconds: 0.4,
            }],
        );
        let mut problems = vec![format!(
            "prompt 1: parts from the reference at 10 of 12 positions, first at position 2 \
             (served {served})"
        )];
        problems.extend(concurrency.problems.iter().cloned());
        EndpointReport {
            api: Api::OpenAi,
            max_tokens: 1,
            model: "/models/tiny_glm".into(),
            problems,
            prompts: vec![PromptCheck {
                comparison,
                continuation: vec![7],
                continuation_differs_at: None,
                health,
                index: 1,
                problems: vec![],
                reference_continuation: vec![7],
                reference_seconds: 0.04,
                server_seconds: 0.03,
                tokens: 12,
                verdict: Status::Fail,
            }],
            served_model: served.into(),
            top_k: 4,
            top_k_served: 4,
            url: "http://127.0.0.1:8000".into(),
            verdict: Status::Fail,
            explanation: Some(explanation),
            concurrency: Some(concurrency),
        }
    }

    #[test]
    fn a_hostile_served_model_name_is_shown_not_rendered() {
        let md = markdown(&failing_report("<script>|*_"));
        assert!(!md.contains("<script"), "{md}");
        assert!(md.contains("serving &lt;script&gt;\\|\\*\\_"), "{md}");
        assert!(
            md.contains("(served &lt;script&gt;\\|\\*\\_)"),
            "the problem text is escaped too: {md}"
        );
    }

    #[test]
    fn a_failing_report_shows_its_parting_concurrency_and_ranking() {
        let md = markdown(&failing_report("served"));
        assert!(
            md.starts_with("### ❌ glmcheck endpoint: **FAIL**\n"),
            "{md}"
        );
        assert!(md.contains("· top-4 log-probabilities"), "{md}");
        assert!(md.contains("· tolerance 0.5 nats"), "{md}");
        assert!(
            md.contains("| position 2 of 12 (10 part) |"),
            "the first parting in the comparison's row: {md}"
        );
        assert!(md.contains("**First parting:** position 2: \\|Δ logprob\\| 1.000"));
        // Five positions from the first parting, the first of them beyond the tolerance.
        assert!(
            md.contains("| 2 | 7 | 7 | 0.0020 | -0.0100 | **1.0000** |"),
            "{md}"
        );
        assert!(md.contains("| 6 | 7 | 7 |"), "{md}");
        assert!(!md.contains("| 7 | 7 | 7 |"), "{md}");
        assert!(md.contains("… and 5 more positions."), "{md}");
        assert!(md.contains("#### ❌ Concurrency — FAIL"), "{md}");
        assert!(md.contains("| 1 | 1.2500 | position 4, token 11 | 1 of 12 | no | 0.40 |"));
        assert!(
            md.contains("**Verdict: explained** — rope-neox explains it"),
            "{md}"
        );
        assert!(
            md.contains("<details><summary>Ranking: 12 hypotheses"),
            "{md}"
        );
        assert!(md.contains("| 1 | `rope-neox` | 2.000e-6 | 0.02 |"), "{md}");
        assert!(md.contains("- note: fp16-overflow not tried"), "{md}");
        assert!(md.contains("*Rule:* a fault explains the server"), "{md}");
        assert!(
            md.contains("- prompt 1: concurrency\\_dependence: beside 3"),
            "{md}"
        );
        assert!(!md.contains("PASS:"), "{md}");
    }
}
