//! llama.cpp's `llama-server`, asked through its native `/completion` endpoint: the requests,
//! and the answers read back into the [`Answer`] the OpenAI path gives.
//!
//! llama-server gives no log-probabilities for prompt positions on any endpoint (its
//! `/v1/completions` takes `echo` and gives nothing back for it). What it does give is the next
//! token's top-k before sampling: `n_probs: K` on `/completion` answers, per generated token, an
//! entry of `completion_probabilities` whose `top_logprobs` lists `{"id", "token", "bytes",
//! "logprob"}`, the most probable first, each the log of a softmax over the raw logits (no
//! sampler, logit bias or temperature touches them while `post_sampling_probs` is off). So prompt
//! position `i` is one request: the first `i + 1` prompt ids as the prompt (a JSON array of ids
//! is taken as is, without a BOS) and one token to predict. With `cache_prompt` each such
//! request reuses the previous one's KV cache and computes a single new token.
//!
//! The token predicted is forced to an ASCII letter by `logit_bias`: llama-server holds back a
//! token that ends inside a UTF-8 sequence until the sequence is complete, and with it that
//! token's probabilities, which a one-token request would then never give. The bias acts in the
//! sampler only, after the probabilities were taken.
//!
//! The greedy continuation is one more request on the whole prompt (`return_tokens` hands back
//! its ids). A `-∞` log-probability (a probability of 0) is written as the most negative f32,
//! and NaN as `null`; both read back as such.

use serde::Deserialize;
use serde_json::json;

use super::openai::{Answer, TopK};

/// The endpoint asked.
pub const COMPLETION: &str = "/completion";

/// The endpoint that tells llama-server apart: it answers with its settings, vLLM with 404.
pub const PROPS: &str = "/props";

/// The text whose tokens are forced as the one token predicted: ASCII, so that no UTF-8
/// sequence is left open ([`next_token_request`]).
const FORCED: &str = "a";

/// The bias that forces [`FORCED`]: far above any logit a healthy model gives.
const FORCING_BIAS: f64 = 1e4;

/// Whether a `/props` answer is llama-server's (its `default_generation_settings`).
pub fn is_props(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text)
        .is_ok_and(|v| v.get("default_generation_settings").is_some())
}

/// The request for the next token's top `top_k` after `prefix` (the first ids of a prompt).
pub fn next_token_request(prefix: &[u32], top_k: u32) -> serde_json::Value {
    json!({
        "prompt": prefix,
        "n_predict": 1,
        "n_probs": top_k,
        "post_sampling_probs": false,
        "temperature": 0,
        "top_k": 1,
        "logit_bias": [[FORCED, FORCING_BIAS]],
        "cache_prompt": true,
    })
}

/// The request for a greedy continuation of `max_tokens` after the whole prompt.
pub fn continuation_request(tokens: &[u32], max_tokens: u32) -> serde_json::Value {
    json!({
        "prompt": tokens,
        "n_predict": max_tokens,
        "temperature": 0,
        "top_k": 1,
        "return_tokens": true,
        "cache_prompt": true,
    })
}

#[derive(Deserialize)]
struct Completion {
    #[serde(default)]
    completion_probabilities: Option<Vec<Generated>>,
    #[serde(default)]
    tokens: Option<Vec<u32>>,
    #[serde(default)]
    tokens_evaluated: Option<usize>,
}

#[derive(Deserialize)]
struct Generated {
    top_logprobs: Option<Vec<Listed>>,
}

#[derive(Deserialize)]
struct Listed {
    id: u32,
    /// `null` where the server had a NaN.
    logprob: Option<f64>,
}

fn completion(text: &str) -> Result<Completion, String> {
    serde_json::from_str(text).map_err(|e| format!("not a /completion answer: {e}"))
}

/// Check that the server evaluated as many prompt tokens as were sent (one more: a BOS added).
fn check_evaluated(c: &Completion, sent: usize) -> Result<(), String> {
    match c.tokens_evaluated {
        Some(n) if n != sent => Err(format!(
            "tokens_evaluated is {n} where {sent} ids were sent: the server did not take the token ids as sent"
        )),
        _ => Ok(()),
    }
}

/// Read the answer to [`next_token_request`] on `sent` ids: the next token's top-k, the most
/// probable first. An error names the field that is missing or malformed.
pub fn parse_next_token(text: &str, sent: usize) -> Result<TopK, String> {
    let c = completion(text)?;
    check_evaluated(&c, sent)?;
    let Some(first) = c
        .completion_probabilities
        .and_then(|p| p.into_iter().next())
    else {
        return Err(
            "completion_probabilities: missing or empty (the server ignored n_probs)".into(),
        );
    };
    let Some(listed) = first.top_logprobs else {
        return Err(
            "completion_probabilities[0].top_logprobs: missing (post-sampling probabilities?)"
                .into(),
        );
    };
    if listed.is_empty() {
        return Err("completion_probabilities[0].top_logprobs: empty".into());
    }
    let mut top: TopK = listed
        .into_iter()
        .map(|l| (l.id, as_read(l.logprob)))
        .collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(top)
}

/// A log-probability as read: `null` is NaN, the most negative f32 (the server's stand-in for
/// the log of 0) is −∞.
fn as_read(lp: Option<f64>) -> f64 {
    match lp {
        None => f64::NAN,
        Some(v) if v <= f64::from(f32::MIN) => f64::NEG_INFINITY,
        Some(v) => v,
    }
}

/// Read the answer to [`continuation_request`] on `sent` ids: the generated ids.
pub fn parse_continuation(text: &str, sent: usize) -> Result<Vec<u32>, String> {
    let c = completion(text)?;
    check_evaluated(&c, sent)?;
    c.tokens
        .ok_or_else(|| "tokens: missing (the server ignored return_tokens)".into())
}

/// The answers for one prompt as an [`Answer`]: `next[i]` is the top-k after the first `i + 1`
/// prompt ids, so it predicts prompt token `i + 1`, and the last one the first generated token.
pub fn answer(next: Vec<TopK>, generated: Vec<u32>) -> Answer {
    let mut prompt_top: Vec<Option<TopK>> = vec![None];
    let mut next = next.into_iter().map(Some).collect::<Vec<_>>();
    let last = next.pop().flatten();
    prompt_top.extend(next);
    Answer {
        prompt_ids: None,
        prompt_top,
        generated,
        generated_top: vec![last],
        lists_prompt_token: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama-server's answer (llama.cpp of llama-cpp-python 0.3.36, F32 KV cache, flash
    /// attention off) to `next_token_request(&[1, 5, 9], 3)` on glmcheck's synthetic GGUF.
    const NEXT: &str = r#"{"index":0,"content":"a","tokens":[],"id_slot":0,"stop":true,"model":"syn.gguf","tokens_predicted":1,"tokens_evaluated":3,"generation_settings":{"seed":4294967295,"temperature":0.0,"dynatemp_range":0.0,"dynatemp_exponent":1.0,"top_k":1,"top_p":0.949999988079071,"min_p":0.05000000074505806,"top_n_sigma":-1.0,"xtc_probability":0.0,"xtc_threshold":0.10000000149011612,"typical_p":1.0,"repeat_last_n":64,"repeat_penalty":1.0,"presence_penalty":0.0,"frequency_penalty":0.0,"dry_multiplier":0.0,"dry_base":1.75,"dry_allowed_length":2,"dry_penalty_last_n":64,"dry_sequence_breakers":["\n",":","\"","*"],"mirostat":0,"mirostat_tau":5.0,"mirostat_eta":0.10000000149011612,"adaptive_target":-1.0,"adaptive_decay":0.8999999761581421,"stop":[],"max_tokens":1,"n_predict":1,"n_keep":0,"n_discard":0,"ignore_eos":false,"stream":false,"logit_bias":[{"bias":10000.0,"token":97}],"n_probs":3,"min_keep":0,"grammar":"","grammar_lazy":false,"grammar_triggers":[],"preserved_tokens":[],"chat_format":"Content-only","reasoning_format":"deepseek","reasoning_in_content":false,"generation_prompt":"","samplers":["penalties","dry","top_n_sigma","top_k","typ_p","top_p","min_p","xtc","temperature"],"speculative.types":"none","timings_per_token":false,"post_sampling_probs":false,"backend_sampling":false,"lora":[]},"prompt":"\u0001\u0005\t","has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":3,"timings":{"cache_n":0,"prompt_n":3,"prompt_ms":2182.679,"prompt_per_token_ms":727.5596666666667,"prompt_per_second":1.3744577191607195,"predicted_n":1,"predicted_ms":0.001,"predicted_per_token_ms":0.0,"predicted_per_second":0.0},"completion_probabilities":[{"id":97,"token":"a","bytes":[97],"logprob":-14.71304702758789,"top_logprobs":[{"id":10,"token":"\n","bytes":[10],"logprob":-0.00021549400116782635},{"id":104,"token":"h","bytes":[104],"logprob":-9.658727645874023},{"id":157,"token":"�","bytes":[157],"logprob":-10.878150939941406}]}]}"#;

    /// Its answer to `continuation_request(&[1, 5, 9, 14], 3)` right after, on the same model.
    const CONTINUATION: &str = r#"{"index":0,"content":"\u000f\u0010\u0011","tokens":[15,16,17],"id_slot":0,"stop":true,"model":"syn.gguf","tokens_predicted":3,"tokens_evaluated":4,"generation_settings":{"seed":4294967295,"temperature":0.0,"dynatemp_range":0.0,"dynatemp_exponent":1.0,"top_k":1,"top_p":0.949999988079071,"min_p":0.05000000074505806,"top_n_sigma":-1.0,"xtc_probability":0.0,"xtc_threshold":0.10000000149011612,"typical_p":1.0,"repeat_last_n":64,"repeat_penalty":1.0,"presence_penalty":0.0,"frequency_penalty":0.0,"dry_multiplier":0.0,"dry_base":1.75,"dry_allowed_length":2,"dry_penalty_last_n":64,"dry_sequence_breakers":["\n",":","\"","*"],"mirostat":0,"mirostat_tau":5.0,"mirostat_eta":0.10000000149011612,"adaptive_target":-1.0,"adaptive_decay":0.8999999761581421,"stop":[],"max_tokens":3,"n_predict":3,"n_keep":0,"n_discard":0,"ignore_eos":false,"stream":false,"logit_bias":[],"n_probs":0,"min_keep":0,"grammar":"","grammar_lazy":false,"grammar_triggers":[],"preserved_tokens":[],"chat_format":"Content-only","reasoning_format":"deepseek","reasoning_in_content":false,"generation_prompt":"","samplers":["penalties","dry","top_n_sigma","top_k","typ_p","top_p","min_p","xtc","temperature"],"speculative.types":"none","timings_per_token":false,"post_sampling_probs":false,"backend_sampling":false,"lora":[]},"prompt":"\u0001\u0005\t\u000e","has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":6,"timings":{"cache_n":3,"prompt_n":1,"prompt_ms":1331.204,"prompt_per_token_ms":1331.204,"prompt_per_second":0.7511996658663886,"predicted_n":3,"predicted_ms":1778.312,"predicted_per_token_ms":889.156,"predicted_per_second":1.1246620390572633}}"#;

    /// Its `GET /props` answer.
    const PROPS_ANSWER: &str = r#"{"default_generation_settings":{"params":{"seed":4294967295,"temperature":0.800000011920929,"dynatemp_range":0.0,"dynatemp_exponent":1.0,"top_k":40,"top_p":0.949999988079071,"min_p":0.05000000074505806,"top_n_sigma":-1.0,"xtc_probability":0.0,"xtc_threshold":0.10000000149011612,"typical_p":1.0,"repeat_last_n":64,"repeat_penalty":1.0,"presence_penalty":0.0,"frequency_penalty":0.0,"dry_multiplier":0.0,"dry_base":1.75,"dry_allowed_length":2,"dry_penalty_last_n":64,"mirostat":0,"mirostat_tau":5.0,"mirostat_eta":0.10000000149011612,"adaptive_target":-1.0,"adaptive_decay":0.8999999761581421,"max_tokens":-1,"n_predict":-1,"n_keep":0,"n_discard":0,"ignore_eos":false,"stream":false,"n_probs":0,"min_keep":0,"chat_format":"Content-only","reasoning_format":"none","reasoning_in_content":false,"generation_prompt":"","samplers":["penalties","dry","top_n_sigma","top_k","typ_p","top_p","min_p","xtc","temperature"],"speculative.types":"none","timings_per_token":false,"post_sampling_probs":false,"backend_sampling":false,"lora":[]},"n_ctx":256},"total_slots":1,"model_alias":"syn.gguf","model_ftype":"all F32","model_path":"syn.gguf","modalities":{"vision":false,"video":false,"audio":false},"media_marker":"<__media_egVqnzOsx0ysnWmee02eNRr52eue1KXQ__>","endpoint_slots":true,"endpoint_props":false,"endpoint_metrics":false,"ui":false,"ui_settings":{},"chat_template":"{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\n' -}}\n{%- endif -%}","chat_template_caps":{"supports_object_arguments":false,"supports_parallel_tool_calls":false,"supports_preserve_reasoning":false,"supports_reasoning_effort":false,"supports_string_content":true,"supports_system_role":true,"supports_tool_calls":false,"supports_tools":false,"supports_typed_content":false},"bos_token":"[gMASK]","eos_token":"<|endoftext|>","build_info":"b575-cbf358e","is_sleeping":false,"cors_proxy_enabled":false}"#;

    #[test]
    fn a_real_props_answer_is_llama_servers() {
        assert!(is_props(PROPS_ANSWER));
    }

    #[test]
    fn a_real_answer_reads_as_the_raw_top_k_and_the_continuation_as_ids() {
        // The forced "a" (id 97) was sampled; the listed tokens are the model's own top 3.
        let top = parse_next_token(NEXT, 3).unwrap();
        let ids: Vec<u32> = top.iter().map(|e| e.0).collect();
        assert_eq!(ids, vec![10, 104, 157]);
        assert_eq!(top[0].1, -0.00021549400116782635);
        assert_eq!(top[2].1, -10.878150939941406);
        assert!(parse_next_token(NEXT, 4)
            .unwrap_err()
            .starts_with("tokens_evaluated is 3 where 4 ids were sent"));
        assert_eq!(
            parse_continuation(CONTINUATION, 4).unwrap(),
            vec![15, 16, 17]
        );
    }

    #[test]
    fn requests_ask_for_the_raw_top_k_of_one_forced_ascii_token() {
        let r = next_token_request(&[1, 5], 4);
        assert_eq!(r["prompt"], json!([1, 5]));
        assert_eq!(
            (r["n_predict"].as_u64(), r["n_probs"].as_u64()),
            (Some(1), Some(4))
        );
        assert_eq!(r["post_sampling_probs"], false);
        assert_eq!(r["logit_bias"], json!([["a", 1e4]]));
        assert_eq!(r["cache_prompt"], true);
        let c = continuation_request(&[1, 5], 3);
        assert_eq!(
            (c["n_predict"].as_u64(), c["top_k"].as_u64()),
            (Some(3), Some(1))
        );
        assert_eq!(c["return_tokens"], true);
    }

    #[test]
    fn answers_lay_out_as_prompt_positions_then_the_first_generated_token() {
        let a = answer(vec![vec![(3, -0.1)], vec![(4, -0.2)]], vec![4, 9]);
        assert_eq!(a.prompt_top, vec![None, Some(vec![(3, -0.1)])]);
        assert_eq!(a.generated_top, vec![Some(vec![(4, -0.2)])]);
        assert_eq!(a.generated, vec![4, 9]);
        assert!(!a.lists_prompt_token && a.prompt_ids.is_none());
    }

    #[test]
    fn non_finite_log_probabilities_read_back() {
        let text = r#"{"tokens_evaluated":1,"completion_probabilities":[{"id":97,"top_logprobs":[{"id":4,"logprob":-3.4028234663852886e38},{"id":6,"logprob":null},{"id":2,"logprob":-0.5}]}]}"#;
        let top = parse_next_token(text, 1).unwrap();
        // NaN sorts first (as in the OpenAI path's lists), −∞ last.
        assert_eq!(top[0].0, 6);
        assert!(top[0].1.is_nan());
        assert_eq!(top[1], (2, -0.5));
        assert_eq!(top[2], (4, f64::NEG_INFINITY));
    }

    #[test]
    fn malformed_answers_name_the_field() {
        assert!(parse_next_token("<html>", 1)
            .unwrap_err()
            .starts_with("not a /completion answer"));
        assert!(parse_next_token(r#"{"content":"a"}"#, 1)
            .unwrap_err()
            .starts_with("completion_probabilities: missing"));
        let probs = r#"{"completion_probabilities":[{"id":1,"top_probs":[]}]}"#;
        assert!(parse_next_token(probs, 1)
            .unwrap_err()
            .starts_with("completion_probabilities[0].top_logprobs: missing"));
        let bos = r#"{"tokens_evaluated":3,"tokens":[7]}"#;
        assert!(parse_continuation(bos, 2)
            .unwrap_err()
            .starts_with("tokens_evaluated is 3 where 2 ids were sent"));
        assert!(parse_continuation(r#"{"content":""}"#, 2)
            .unwrap_err()
            .starts_with("tokens: missing"));
        assert!(!is_props(r#"{"detail":"Not Found"}"#) && !is_props("Not Found"));
    }
}
