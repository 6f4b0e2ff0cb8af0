//! The OpenAI completion API as vLLM 0.32 serves it (`/v1/completions`), for one prompt given
//! as token ids: the request, and the answer read back.
//!
//! The request asks for a greedy continuation (`temperature` 0) and, at every prompt position,
//! the top-k log-probabilities through vLLM's `prompt_logprobs: K` extension. vLLM answers it in
//! `choices[0].prompt_logprobs`: one entry per prompt token, the first `null` (nothing predicts
//! the first token), each other a map from the token id (a JSON string of digits) to
//! `{"logprob", "rank", "decoded_token"}`, holding the top K and the prompt's own token at that
//! position whatever its rank. Entry `i` is the distribution the model gave after tokens
//! `0..i`, so it belongs to the reference's logits row `i − 1`. The last prompt position's
//! distribution is the first generated token's: `logprobs: K` with `return_tokens_as_token_ids`
//! gives it in `choices[0].logprobs.top_logprobs[0]`, keyed `"token_id:ID"`. With
//! `return_token_ids` vLLM also hands back the prompt's ids as it took them
//! (`choices[0].prompt_token_ids`) and the generated ones (`choices[0].token_ids`).
//!
//! vLLM clamps a −∞ log-probability to −9999; a NaN or ∞ that reaches the answer is written as
//! Python's `NaN`/`Infinity`, which JSON does not have: such a bare word outside strings reads
//! as a non-finite number here (kept as such, for the health check) rather than as garbage.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::json;

/// One position's log-probabilities as the server gave them: `(token id, log-probability)`,
/// the most probable first.
pub type TopK = Vec<(u32, f64)>;

/// The `/v1/completions` request for `tokens`: a greedy continuation of `max_tokens` and the
/// top `top_k` log-probabilities at every prompt position and generated token.
pub fn completion_request(
    served_model: &str,
    tokens: &[u32],
    top_k: u32,
    max_tokens: u32,
) -> serde_json::Value {
    json!({
        "model": served_model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "prompt_logprobs": top_k,
        "logprobs": top_k,
        "return_tokens_as_token_ids": true,
        "return_token_ids": true,
    })
}

/// The server's answer for one prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    /// The prompt's ids as the server took them, where it said.
    pub prompt_ids: Option<Vec<u32>>,
    /// Per prompt token (the first `None`): the top-k predicting it, as served.
    pub prompt_top: Vec<Option<TopK>>,
    /// The generated tokens.
    pub generated: Vec<u32>,
    /// Per generated token, the top-k it was chosen from (the first: the last prompt
    /// position's distribution).
    pub generated_top: Vec<Option<TopK>>,
    /// Whether every prompt position's list holds the prompt's own token at that position,
    /// whatever its rank (vLLM's `prompt_logprobs` does; a plain top-k need not): when it does,
    /// a missing one means the server did not take the ids as sent.
    pub lists_prompt_token: bool,
}

#[derive(Deserialize)]
struct Completion {
    choices: Vec<Choice>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    prompt_logprobs: Option<Vec<Option<BTreeMap<String, PromptEntry>>>>,
    #[serde(default)]
    prompt_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    logprobs: Option<ChoiceLogprobs>,
}

#[derive(Deserialize)]
struct PromptEntry {
    /// `null` where the answer held a `NaN`.
    logprob: Option<f64>,
}

#[derive(Deserialize)]
struct ChoiceLogprobs {
    #[serde(default)]
    tokens: Vec<String>,
    #[serde(default)]
    top_logprobs: Vec<Option<BTreeMap<String, Option<f64>>>>,
}

/// A token key: vLLM's `"123"` (prompt log-probabilities) or `"token_id:123"` (the completion
/// API's own, with `return_tokens_as_token_ids`).
fn token_key(key: &str) -> Option<u32> {
    key.strip_prefix("token_id:").unwrap_or(key).parse().ok()
}

/// A log-probability as read: `null` is NaN, ±1e308 is ±∞ ([`non_finite_as_json`]).
fn as_read(lp: Option<f64>) -> f64 {
    match lp {
        None => f64::NAN,
        Some(v) if v.abs() >= 1e308 => v.signum() * f64::INFINITY,
        Some(v) => v,
    }
}

/// A map of token keys to log-probabilities as a [`TopK`], the most probable first; `where_`
/// names the field in errors.
fn top_k<'a>(
    entries: impl Iterator<Item = (&'a String, Option<f64>)>,
    where_: &str,
) -> Result<TopK, String> {
    let mut top = entries
        .map(|(key, lp)| match token_key(key) {
            Some(id) => Ok((id, as_read(lp))),
            None => Err(format!(
                "{where_}: key {key:?} is not a token id (the server ignored return_tokens_as_token_ids)"
            )),
        })
        .collect::<Result<TopK, String>>()?;
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(top)
}

/// Read a `/v1/completions` answer; an error names the field that is missing or malformed.
pub fn parse_answer(text: &str) -> Result<Answer, String> {
    let clean = non_finite_as_json(text);
    let completion: Completion =
        serde_json::from_str(&clean).map_err(|e| format!("not a completion answer: {e}"))?;
    let Some(choice) = completion.choices.into_iter().next() else {
        return Err("choices: empty".into());
    };
    let prompt_top = match &choice.prompt_logprobs {
        Some(positions) => per_position(positions, "choices[0].prompt_logprobs", |e| e.logprob)?,
        None => Vec::new(),
    };
    let (generated_top, from_tokens) = match &choice.logprobs {
        Some(lp) => (
            per_position(&lp.top_logprobs, "choices[0].logprobs.top_logprobs", |v| *v)?,
            lp.tokens
                .iter()
                .map(|t| token_key(t))
                .collect::<Option<Vec<u32>>>(),
        ),
        None => (Vec::new(), None),
    };
    Ok(Answer {
        prompt_ids: choice.prompt_token_ids,
        prompt_top,
        generated: choice.token_ids.or(from_tokens).unwrap_or_default(),
        generated_top,
        lists_prompt_token: true,
    })
}

/// Each position's map of token keys (`null` where the server gave none) as a [`TopK`];
/// `field` names the list in errors, `logprob` reads an entry's log-probability.
fn per_position<E>(
    positions: &[Option<BTreeMap<String, E>>],
    field: &str,
    logprob: impl Fn(&E) -> Option<f64>,
) -> Result<Vec<Option<TopK>>, String> {
    positions
        .iter()
        .enumerate()
        .map(|(i, p)| {
            p.as_ref()
                .map(|m| {
                    top_k(
                        m.iter().map(|(k, e)| (k, logprob(e))),
                        &format!("{field}[{i}]"),
                    )
                })
                .transpose()
        })
        .collect()
}

/// `text` with the bare words `NaN`, `Infinity` and `-Infinity` outside strings (Python's JSON
/// for non-finite floats) replaced by JSON: `null` for NaN, ±1e308 for ±∞ (read back as ±∞).
fn non_finite_as_json(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.contains("NaN") && !text.contains("Infinity") {
        return text.into();
    }
    let mut out = String::with_capacity(text.len());
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else {
            let word = [
                ("NaN", "null"),
                ("Infinity", "1e308"),
                ("-Infinity", "-1e308"),
            ]
            .into_iter()
            .find(|(w, _)| rest.starts_with(w));
            if let Some((w, json)) = word {
                out.push_str(json);
                rest = &rest[w.len()..];
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM 0.32's answer to `completion_request(model, [1, 5, 9, 14], 3, 1)`, served by
    /// `vllm.entrypoints.openai.api_server --skip-tokenizer-init` on a synthetic model.
    const VLLM: &str = r#"{"id":"cmpl-99a1636131cb7700","object":"text_completion","created":1796587427,"model":"/tmp/ep/hf","choices":[{"index":0,"text":"","logprobs":{"text_offset":[0],"token_logprobs":[-3.671578815556131e-05],"tokens":["token_id:15"],"top_logprobs":[{"token_id:15":-3.671578815556131e-05,"token_id:121":-12.359231948852539,"token_id:104":-12.52835464477539}]},"finish_reason":"length","stop_reason":null,"token_ids":[15],"prompt_logprobs":[null,{"5":{"logprob":-19.141170501708984,"rank":361,"decoded_token":null},"2":{"logprob":-2.1934269170742482e-05,"rank":1,"decoded_token":null},"115":{"logprob":-13.597983360290527,"rank":2,"decoded_token":null},"220":{"logprob":-14.022056579589844,"rank":3,"decoded_token":null}},{"9":{"logprob":-16.651321411132812,"rank":119,"decoded_token":null},"6":{"logprob":-3.981510963058099e-05,"rank":1,"decoded_token":null},"32":{"logprob":-12.120906829833984,"rank":2,"decoded_token":null},"121":{"logprob":-12.462301254272461,"rank":3,"decoded_token":null}},{"14":{"logprob":-15.242681503295898,"rank":120,"decoded_token":null},"10":{"logprob":-0.00015627116954419762,"rank":1,"decoded_token":null},"104":{"logprob":-9.769281387329102,"rank":2,"decoded_token":null},"157":{"logprob":-12.506093978881836,"rank":3,"decoded_token":null}}],"prompt_token_ids":[1,5,9,14],"routed_experts":null}],"service_tier":null,"system_fingerprint":"vllm-0.32.0-745d4ff2","usage":{"prompt_tokens":4,"total_tokens":5,"completion_tokens":1,"prompt_tokens_details":null,"completion_tokens_details":null},"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}"#;

    #[test]
    fn a_vllm_answer_reads_as_ids_and_sorted_log_probabilities() {
        let a = parse_answer(VLLM).unwrap();
        assert_eq!(a.prompt_ids, Some(vec![1, 5, 9, 14]));
        assert_eq!(a.prompt_top.len(), 4);
        assert_eq!(a.prompt_top[0], None);
        let ids = |t: &Option<TopK>| t.as_ref().unwrap().iter().map(|e| e.0).collect::<Vec<_>>();
        // The top 3 and the prompt's own token (5, at rank 361), the most probable first.
        assert_eq!(ids(&a.prompt_top[1]), vec![2, 115, 220, 5]);
        assert_eq!(a.prompt_top[1].as_ref().unwrap()[3].1, -19.141170501708984);
        assert_eq!(ids(&a.prompt_top[3]), vec![10, 104, 157, 14]);
        assert_eq!(a.generated, vec![15]);
        assert_eq!(a.generated_top.len(), 1);
        assert_eq!(ids(&a.generated_top[0]), vec![15, 121, 104]);
    }

    #[test]
    fn the_request_asks_for_ids_logprobs_and_a_greedy_continuation() {
        let r = completion_request("m", &[1, 2], 5, 3);
        assert_eq!(r["prompt"], json!([1, 2]));
        assert_eq!(
            (r["prompt_logprobs"].as_u64(), r["logprobs"].as_u64()),
            (Some(5), Some(5))
        );
        assert_eq!(r["temperature"], 0);
        assert_eq!(r["return_tokens_as_token_ids"], true);
    }

    #[test]
    fn non_finite_numbers_read_and_strings_keep_their_words() {
        let text = r#"{"choices":[{"text":"NaN Infinity \"NaN\"","prompt_logprobs":[null,{"4":{"logprob":NaN},"6":{"logprob":-Infinity}}]}]}"#;
        let a = parse_answer(text).unwrap();
        let top = a.prompt_top[1].as_ref().unwrap();
        assert_eq!(top[0].0, 4);
        assert!(top[0].1.is_nan());
        assert_eq!(top[1], (6, f64::NEG_INFINITY));
    }

    #[test]
    fn malformed_answers_name_the_field() {
        assert!(parse_answer("<html>")
            .unwrap_err()
            .starts_with("not a completion answer"));
        assert_eq!(
            parse_answer(r#"{"choices":[]}"#).unwrap_err(),
            "choices: empty"
        );
        let words = r#"{"choices":[{"logprobs":{"tokens":["a"],"top_logprobs":[{"a":-1.0}]}}]}"#;
        assert!(parse_answer(words)
            .unwrap_err()
            .starts_with("choices[0].logprobs.top_logprobs[0]: key \"a\""));
        let a = parse_answer(r#"{"choices":[{"text":"x"}]}"#).unwrap();
        assert!(a.prompt_top.is_empty() && a.generated.is_empty());
    }
}
