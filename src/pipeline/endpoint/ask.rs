//! The server's side of `glmcheck endpoint`: the API it speaks and the model it serves, one
//! prompt asked of it, and its answer laid out as the reference's positions.

use std::time::Instant;

use anyhow::anyhow;

use super::{EndpointSpec, Served};
use crate::endpoint::client::{CallError, Client};
use crate::endpoint::llama_server::{self, COMPLETION, PROPS};
use crate::endpoint::openai::{completion_request, parse_answer, Answer, TopK};
use crate::endpoint::Api;

/// The first model the server lists (`/v1/models`), the name requests must give.
pub(super) fn served_model(client: &Client) -> anyhow::Result<String> {
    let url = client.url("/v1/models");
    let text = client.get("/v1/models")?;
    let list: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{url}: not JSON: {e}"))?;
    list.pointer("/data/0/id")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .ok_or_else(|| anyhow!("{url}: data[0].id: no model listed"))
}

/// The API the server speaks: llama-server answers `/props` with its settings; an OpenAI
/// server (vLLM) has no such endpoint and answers 4xx, or something else.
pub(super) fn api(client: &Client) -> anyhow::Result<Api> {
    match client.get(PROPS) {
        Ok(text) if llama_server::is_props(&text) => Ok(Api::LlamaServer),
        Ok(_) => Ok(Api::OpenAi),
        Err(CallError::Status { status, .. }) if status < 500 => Ok(Api::OpenAi),
        Err(e) => Err(e.into()),
    }
}

/// One prompt asked of the server through `api`, its answer checked for what the comparison
/// needs.
pub(super) fn ask(
    client: &Client,
    api: Api,
    served_model: &str,
    tokens: Vec<u32>,
    spec: &EndpointSpec,
) -> anyhow::Result<Served> {
    let began = Instant::now();
    let (answer, url, top_k) = match api {
        Api::OpenAi => {
            let url = client.url("/v1/completions");
            let (text, k) = ask_openai(client, served_model, &tokens, spec.top_k, spec.max_tokens)?;
            (
                parse_answer(&text).map_err(|e| anyhow!("{url}: {e}"))?,
                url,
                k,
            )
        }
        Api::LlamaServer => (
            ask_llama_server(client, &tokens, spec)?,
            client.url(COMPLETION),
            spec.top_k,
        ),
    };
    let seconds = began.elapsed().as_secs_f64();
    let positions = positions(&answer, &tokens).map_err(|e| anyhow!("{url}: {e}"))?;
    Ok(Served {
        top_k,
        tokens,
        positions,
        generated: answer.generated,
        seconds,
    })
}

/// The completion request's answer and the log-probabilities it asked for: `top_k`, or the
/// server's cap where it refuses `top_k` as more than it allows (vLLM's `--max-logprobs`, 20
/// by default) and is asked again.
fn ask_openai(
    client: &Client,
    served_model: &str,
    tokens: &[u32],
    top_k: u32,
    max_tokens: u32,
) -> Result<(String, u32), CallError> {
    let request = completion_request(served_model, tokens, top_k, max_tokens);
    match client.post_json("/v1/completions", &request) {
        Err(CallError::Status {
            status: 400,
            message,
            ..
        }) if logprobs_cap(&message).is_some_and(|cap| cap >= 1 && cap < top_k) => {
            let cap = logprobs_cap(&message).unwrap_or(top_k);
            let request = completion_request(served_model, tokens, cap, max_tokens);
            Ok((client.post_json("/v1/completions", &request)?, cap))
        }
        other => other.map(|text| (text, top_k)),
    }
}

/// The most log-probabilities a server allows, from its refusal ("Requested prompt logprobs of
/// 50, which is greater than max allowed: 20", vLLM's words).
fn logprobs_cap(message: &str) -> Option<u32> {
    let (before, after) = message.split_once("max allowed:")?;
    if !before.contains("logprobs") {
        return None;
    }
    let digits: String = after
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// llama-server asked for each prompt position's next-token top-k, one request on each prefix
/// of the prompt, then for the greedy continuation; an error names the position.
fn ask_llama_server(
    client: &Client,
    tokens: &[u32],
    spec: &EndpointSpec,
) -> anyhow::Result<Answer> {
    let url = client.url(COMPLETION);
    if tokens.is_empty() {
        return Err(anyhow!("{url}: an empty prompt: nothing to ask"));
    }
    let at = |position: usize| format!("position {position} of {}", tokens.len());
    let mut next = Vec::with_capacity(tokens.len());
    for end in 1..=tokens.len() {
        let request = llama_server::next_token_request(&tokens[..end], spec.top_k);
        let text = client
            .post_json(COMPLETION, &request)
            .map_err(|e| anyhow!("{e} (at {})", at(end - 1)))?;
        let top = llama_server::parse_next_token(&text, end)
            .map_err(|e| anyhow!("{url}: {}: {e}", at(end - 1)))?;
        next.push(top);
    }
    let generated = if spec.max_tokens == 0 {
        Vec::new()
    } else {
        let request = llama_server::continuation_request(tokens, spec.max_tokens);
        let text = client
            .post_json(COMPLETION, &request)
            .map_err(|e| anyhow!("{e} (the continuation)"))?;
        llama_server::parse_continuation(&text, tokens.len())
            .map_err(|e| anyhow!("{url}: the continuation: {e}"))?
    };
    Ok(llama_server::answer(next, generated))
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
        if answer.lists_prompt_token && !top.iter().any(|(id, _)| *id == tokens[i]) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_servers_cap_on_log_probabilities_is_read_from_its_refusal() {
        let vllm = "Requested prompt logprobs of 50, which is greater than max allowed: 20";
        assert_eq!(logprobs_cap(vllm), Some(20));
        assert_eq!(logprobs_cap("max allowed: 20 requests"), None);
        assert_eq!(logprobs_cap("prompt logprobs: too many"), None);
    }

    fn answer(ids: Option<Vec<u32>>, top: Vec<Option<TopK>>) -> Answer {
        Answer {
            prompt_ids: ids,
            prompt_top: top,
            generated: vec![7],
            generated_top: vec![Some(vec![(7, -0.1)])],
            lists_prompt_token: true,
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

    #[test]
    fn a_top_k_that_need_not_list_the_prompts_token_is_taken_without_it() {
        let top = vec![None, Some(vec![(3, -0.2)]), Some(vec![(9, -0.5)])];
        let a = Answer {
            lists_prompt_token: false,
            ..answer(None, top)
        };
        assert_eq!(positions(&a, &[1, 5, 9]).unwrap().len(), 3);
    }
}
