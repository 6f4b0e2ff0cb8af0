//! `glmcheck endpoint`: a running OpenAI-compatible server (vLLM) asked for the top-k
//! log-probabilities at every position of a prompt given as token ids, and its answer held
//! against glmcheck's reference forward of the same model on the same ids.
//!
//! The server is asked first, for every prompt, so that a server that cannot answer is known
//! before the reference spends its time. The reference runs on the CPU at f32, TP 1, with the
//! latent RMSNorms at the config's `rms_norm_eps` (as vLLM builds them), its trace kept in a
//! temporary folder that is removed when the check ends: no prompt and no logits are left
//! behind.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};

use super::record::{prompt_tokens, record, RunSpec};
use super::Model;
use crate::any_backend::BackendKind;
use crate::compare::stage_diff::whole_values;
use crate::compare::top_k::{compare, problems, ServerHealth};
use crate::compare::Status;
use crate::dtype::Precision;
use crate::endpoint::client::Client;
use crate::endpoint::openai::{completion_request, parse_answer, Answer, TopK};
use crate::report::endpoint::{EndpointReport, PromptCheck};
use crate::trace::{FullSelector, Trace};

/// What to ask, of which server, against which model.
pub struct EndpointSpec<'a> {
    /// The server's base URL (`http://host:port`).
    pub url: &'a str,
    /// The checkpoint the server serves, here on disk.
    pub model: &'a Path,
    /// Prompt texts, tokenized with the model's tokenizer.
    pub prompts: &'a [String],
    /// A prompt as token ids (empty: none).
    pub tokens: &'a [u32],
    pub top_k: u32,
    pub max_tokens: u32,
    /// The longest the whole exchange with the server may take, retries included.
    pub timeout: Duration,
    /// The tolerance on a log-probability, in nats.
    pub tolerance: f64,
}

/// The server's answer for one prompt, before the reference runs.
struct Served {
    tokens: Vec<u32>,
    /// Per reference position, the server's top-k.
    positions: Vec<TopK>,
    generated: Vec<u32>,
    seconds: f64,
}

/// Ask the server, run the reference, compare.
pub fn check(spec: &EndpointSpec) -> anyhow::Result<EndpointReport> {
    if spec.top_k == 0 {
        bail!("--top-k: at least 1");
    }
    let model = Model::open(spec.model)?;
    let mut prompts = Vec::new();
    for text in spec.prompts {
        prompts.push(prompt_tokens(&model.files, Some(text), &[])?.0);
    }
    if !spec.tokens.is_empty() {
        prompts.push(spec.tokens.to_vec());
    }
    if prompts.is_empty() {
        bail!("give a prompt: --prompt TEXT or --tokens IDS");
    }
    let client = Client::new(spec.url, spec.timeout)?;
    let served_model = served_model(&client)?;
    let served = prompts
        .into_iter()
        .map(|tokens| ask(&client, &served_model, tokens, spec))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut checks = Vec::new();
    for (i, s) in served.into_iter().enumerate() {
        checks.push(judge(&model, s, i + 1, spec)?);
    }
    let problems: Vec<String> = checks
        .iter()
        .flat_map(|c| {
            c.problems
                .iter()
                .map(|p| format!("prompt {}: {p}", c.index))
        })
        .collect();
    Ok(EndpointReport {
        max_tokens: spec.max_tokens,
        model: spec.model.display().to_string(),
        verdict: if problems.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        },
        problems,
        prompts: checks,
        served_model,
        top_k: spec.top_k,
        url: spec.url.to_string(),
    })
}

/// The first model the server lists (`/v1/models`), the name requests must give.
fn served_model(client: &Client) -> anyhow::Result<String> {
    let url = client.url("/v1/models");
    let text = client.get("/v1/models")?;
    let list: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{url}: not JSON: {e}"))?;
    list.pointer("/data/0/id")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .ok_or_else(|| anyhow!("{url}: data[0].id: no model listed"))
}

/// One prompt asked of the server, its answer checked for what the comparison needs.
fn ask(
    client: &Client,
    served_model: &str,
    tokens: Vec<u32>,
    spec: &EndpointSpec,
) -> anyhow::Result<Served> {
    let url = client.url("/v1/completions");
    let began = Instant::now();
    let request = completion_request(served_model, &tokens, spec.top_k, spec.max_tokens);
    let text = client.post_json("/v1/completions", &request)?;
    let seconds = began.elapsed().as_secs_f64();
    let answer = parse_answer(&text).map_err(|e| anyhow!("{url}: {e}"))?;
    let positions = positions(&answer, &tokens).map_err(|e| anyhow!("{url}: {e}"))?;
    Ok(Served {
        tokens,
        positions,
        generated: answer.generated,
        seconds,
    })
}

/// The server's top-k per reference position (row `i` predicts token `i + 1`; the last prompt
/// position's is the first generated token's), after checking that the server took the prompt
/// as the ids sent.
fn positions(answer: &Answer, tokens: &[u32]) -> Result<Vec<TopK>, String> {
    let mismatch = |what: String| {
        format!("{what}: the server did not take the token ids as sent (another tokenizer or vocabulary?)")
    };
    if let Some(ids) = &answer.prompt_ids {
        if ids != tokens {
            let at = ids.iter().zip(tokens).position(|(a, b)| a != b);
            return Err(mismatch(match at {
                Some(i) => format!(
                    "prompt_token_ids[{i}] is {} where {} was sent",
                    ids[i], tokens[i]
                ),
                None => format!(
                    "prompt_token_ids holds {} ids where {} were sent",
                    ids.len(),
                    tokens.len()
                ),
            }));
        }
    }
    if answer.prompt_top.is_empty() {
        return Err(
            "choices[0].prompt_logprobs: no prompt log-probabilities in the answer (the server does not honour vLLM's prompt_logprobs)"
                .into(),
        );
    }
    if answer.prompt_top.len() != tokens.len() {
        return Err(mismatch(format!(
            "choices[0].prompt_logprobs has {} entries for {} tokens sent",
            answer.prompt_top.len(),
            tokens.len()
        )));
    }
    let mut rows = Vec::with_capacity(tokens.len());
    for (i, top) in answer.prompt_top.iter().enumerate().skip(1) {
        let Some(top) = top else {
            return Err(format!("choices[0].prompt_logprobs[{i}]: null"));
        };
        if !top.iter().any(|(id, _)| *id == tokens[i]) {
            return Err(mismatch(format!(
                "choices[0].prompt_logprobs[{i}] lacks the prompt's token {}",
                tokens[i]
            )));
        }
        rows.push(top.clone());
    }
    if let Some(Some(last)) = answer.generated_top.first() {
        rows.push(last.clone());
    }
    if rows.is_empty() {
        return Err("a one-token prompt without the first generated token's log-probabilities: nothing to compare".into());
    }
    Ok(rows)
}

/// The reference's forward on the served prompt, compared with the server's answer.
fn judge(
    model: &Model,
    served: Served,
    index: usize,
    spec: &EndpointSpec,
) -> anyhow::Result<PromptCheck> {
    let dir = tempfile::tempdir().context("a temporary folder for the reference's trace")?;
    let out = dir.path().join("reference.trace");
    let began = Instant::now();
    let recorded = record(RunSpec {
        model,
        tokens: &served.tokens,
        out: &out,
        full: FullSelector::new(&["logits"])?,
        latent_norm_eps: model.cfg.rms_norm_eps,
        dtype: Precision::F32,
        tp: 1,
        ep: false,
        backend: BackendKind::Cpu,
        process: None,
        inject: None,
        generate: spec.max_tokens as usize,
        warm_up: 0,
        ties: None,
        stored_as: None,
        hybrid: None,
    })?;
    let reference_seconds = began.elapsed().as_secs_f64();
    let trace = Trace::open(&out)?;
    let Some((logits, shape)) = whole_values(&trace, "logits")? else {
        bail!("the reference's trace holds no logits");
    };
    let vocab = *shape.last().unwrap_or(&1) as usize;
    let rows = served.positions.len();
    let logits = &logits[..rows * vocab];
    let comparison = compare(logits, vocab, &served.positions, spec.tolerance)
        .map_err(|e| anyhow!("{}: {e}", spec.url))?;
    let health = ServerHealth::of(
        &served.positions,
        &comparison,
        logits,
        vocab,
        &served.generated,
        &recorded.generated,
    );
    let problems = problems(&comparison, &health);
    Ok(PromptCheck {
        continuation_differs_at: served
            .generated
            .iter()
            .zip(&recorded.generated)
            .position(|(a, b)| a != b),
        comparison,
        continuation: served.generated,
        health,
        index,
        verdict: if problems.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        },
        problems,
        reference_continuation: recorded.generated,
        reference_seconds,
        server_seconds: served.seconds,
        tokens: served.tokens.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(ids: Option<Vec<u32>>, top: Vec<Option<TopK>>) -> Answer {
        Answer {
            prompt_ids: ids,
            prompt_top: top,
            generated: vec![7],
            generated_top: vec![Some(vec![(7, -0.1)])],
        }
    }

    #[test]
    fn rows_are_the_prompt_positions_then_the_first_generated_token() {
        let top = vec![
            None,
            Some(vec![(3, -0.2), (5, -3.0)]),
            Some(vec![(9, -0.5)]),
        ];
        let rows = positions(&answer(Some(vec![1, 5, 9]), top), &[1, 5, 9]).unwrap();
        assert_eq!(
            rows,
            vec![vec![(3, -0.2), (5, -3.0)], vec![(9, -0.5)], vec![(7, -0.1)]]
        );
    }

    #[test]
    fn ids_not_taken_as_sent_or_missing_log_probabilities_cannot_be_judged() {
        let top = vec![None, Some(vec![(3, -0.2)]), Some(vec![(9, -0.5)])];
        let e = positions(&answer(Some(vec![1, 6, 9]), top.clone()), &[1, 5, 9]).unwrap_err();
        assert!(
            e.starts_with("prompt_token_ids[1] is 6 where 5 was sent"),
            "{e}"
        );
        let e = positions(&answer(None, top), &[1, 5, 9]).unwrap_err();
        assert!(e.contains("lacks the prompt's token 5"), "{e}");
        let e = positions(&answer(None, vec![]), &[1, 5, 9]).unwrap_err();
        assert!(e.contains("no prompt log-probabilities"), "{e}");
    }
}
