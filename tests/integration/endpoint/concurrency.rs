//! `glmcheck endpoint --concurrency N` against the tiny HTTP server of `mod.rs`: a server
//! whose answer for one request changes while others are in flight is caught (exit 1, the
//! `concurrency_dependence` class, the position and the size of the move), one that keeps its
//! answer is not accused, and a request beside the prompt that fails ends in exit 2. Also the
//! prompts of a `--prompts` file, and `--kv-type`'s tolerance.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::{
    completions, endpoint, logits_of, model_and_logits, serve, vllm_answer, Reply, TOKENS,
};
use crate::common;

/// A server that answers the prompt ([`TOKENS`]) with `alone`, or with `crowded` when another
/// request is in flight as it answers; every other request is answered after 300 ms, so that
/// requests released together overlap. Also: how many other requests it had.
fn crowd_sensitive(alone: Value, crowded: Value) -> (String, Arc<AtomicUsize>) {
    let in_flight = Arc::new(AtomicUsize::new(0));
    let others = Arc::new(AtomicUsize::new(0));
    let counted = others.clone();
    let (url, _) = serve(completions(move |body| {
        in_flight.fetch_add(1, Ordering::SeqCst);
        let answer = if body["prompt"] == json!(TOKENS) {
            // Let requests released at the same instant arrive.
            std::thread::sleep(Duration::from_millis(100));
            if in_flight.load(Ordering::SeqCst) > 1 {
                crowded.clone()
            } else {
                alone.clone()
            }
        } else {
            counted.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            alone.clone()
        };
        in_flight.fetch_sub(1, Ordering::SeqCst);
        Reply::Answer(200, answer.to_string())
    }));
    (url, others)
}

fn report(out: &std::process::Output, code: i32) -> Value {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_server_whose_answer_moves_beside_other_requests_is_caught_and_a_steady_one_is_not() {
    let dir = common::scratch();
    let (model, logits, vocab) = model_and_logits(dir.path());
    let honest = vllm_answer(&logits, vocab, 4);
    // Beside others the server answers as the model with NeoX rotary pairs would: another
    // request's tokens in its attention move it as far.
    let (moved, _) = logits_of(&model, dir.path(), &["--inject", "rope-neox"]);
    let crowded = vllm_answer(&moved, vocab, 4);

    let (url, others) = crowd_sensitive(honest.clone(), crowded);
    let v = report(
        &endpoint(&url, &model, &["--concurrency", "3", "--json"]),
        1,
    );
    assert_eq!(others.load(Ordering::SeqCst), 3 * 3, "3 beside, 3 rounds");
    // Alone it agrees with the reference; beside others it moves.
    assert_eq!(v["prompts"][0]["verdict"], "pass", "{v:#}");
    assert_eq!(v["verdict"], "fail", "{v:#}");
    let c = &v["concurrency"];
    assert_eq!(c["class"], "concurrency_dependence");
    assert_eq!(
        (c["beside"].as_u64(), c["rounds"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(c["verdict"], "fail");
    let d = &c["prompts"][0]["drift"];
    assert!(d["max_abs_delta_logprob"].as_f64().unwrap() > 0.5, "{c:#}");
    assert!(d["at"]["position"].as_u64().unwrap() < 5, "{c:#}");
    let problem = v["problems"][0].as_str().unwrap();
    assert!(
        problem.starts_with("prompt 1: concurrency_dependence: beside 3 other requests"),
        "{problem}"
    );
    let text = endpoint(&url, &model, &["--concurrency", "3"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("concurrency: each prompt asked 3 time(s) beside 3 other requests"),
        "{text}"
    );
    assert!(
        text.contains("FAIL: prompt 1: concurrency_dependence"),
        "{text}"
    );

    // A server that keeps its answer: not accused.
    let (url, others) = crowd_sensitive(honest.clone(), honest);
    let v = report(
        &endpoint(&url, &model, &["--concurrency", "2", "--json"]),
        0,
    );
    assert_eq!(others.load(Ordering::SeqCst), 2 * 3);
    let c = &v["concurrency"];
    assert_eq!(c["verdict"], "pass", "{c:#}");
    assert_eq!(c["prompts"][0]["drift"]["max_abs_delta_logprob"], 0.0);
    assert_eq!(v["problems"], json!([]));
}

#[test]
fn a_request_beside_the_prompt_that_fails_cannot_be_judged() {
    let dir = common::scratch();
    let (model, logits, vocab) = model_and_logits(dir.path());
    let honest = vllm_answer(&logits, vocab, 4);
    let (url, _) = serve(completions(move |body| {
        if body["prompt"] == json!(TOKENS) {
            Reply::Answer(200, honest.to_string())
        } else {
            Reply::Answer(400, r#"{"error":{"message":"too many requests"}}"#.into())
        }
    }));
    let out = endpoint(&url, &model, &["--concurrency", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("--concurrency: prompt 1 beside others: request")
            && stderr.contains("HTTP 400: too many requests"),
        "{stderr}"
    );
}

/// `--prompts FILE`: a text line and a `tokens:` line are two prompts; `--kv-type f32` holds the
/// server to 0.05 nats, so a move of 0.2 that bf16's 0.5 lets pass fails.
#[test]
fn prompts_come_from_a_file_and_the_kv_type_sets_the_tolerance() {
    let dir = common::scratch();
    let (model, logits, vocab) = model_and_logits(dir.path());
    let mut nudged = vllm_answer(&logits, vocab, 4);
    for entry in nudged["choices"][0]["prompt_logprobs"][2]
        .as_object_mut()
        .unwrap()
        .values_mut()
    {
        let lp = entry["logprob"].as_f64().unwrap();
        entry["logprob"] = json!(lp - 0.2);
    }
    let (url, _) = serve(completions(move |_| Reply::Answer(200, nudged.to_string())));
    let file = dir.path().join("prompts.txt");
    let ids: Vec<String> = TOKENS.iter().map(u32::to_string).collect();
    std::fs::write(&file, format!("\ntokens: {}\n\n", ids.join(","))).unwrap();
    let args = |extra: &[&str]| {
        let mut a = vec![
            "endpoint".to_string(),
            url.clone(),
            model.to_str().unwrap().into(),
            "--prompts".into(),
            file.to_str().unwrap().into(),
            "--max-tokens".into(),
            "1".into(),
            "--top-k".into(),
            "4".into(),
            "--json".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let v = common::glmcheck_json(args(&[]), 0);
    assert_eq!(v["prompts"].as_array().unwrap().len(), 1);
    assert_eq!(v["prompts"][0]["comparison"]["tolerance"], 0.5);
    let v = common::glmcheck_json(args(&["--kv-type", "f32"]), 1);
    let c = &v["prompts"][0]["comparison"];
    assert_eq!(c["tolerance"], 0.05);
    assert_eq!(c["first_parting"]["position"], 1, "{c:#}");

    std::fs::write(&file, "tokens: 1,x\n").unwrap();
    let out = common::glmcheck_output(&args(&[]).iter().map(String::as_str).collect::<Vec<_>>());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "glmcheck: error: {}: line 1: token ids:",
            file.display()
        )),
        "{stderr}"
    );
}
