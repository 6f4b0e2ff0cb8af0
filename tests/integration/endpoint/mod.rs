//! `glmcheck endpoint` against a tiny HTTP server started here: answers that agree with the
//! reference (exit 0), one that parts from it (exit 1, the position named), and every way a
//! server cannot be judged (a 5xx after the retries, garbage, silence past `--timeout`, no
//! log-probabilities, ids not taken as sent, nothing listening): exit 2 with one line.

mod concurrency;
mod explain;
mod reports;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common;

/// What the fake server does with a request.
pub(crate) enum Reply {
    Answer(u16, String),
    /// Reads the request and never answers.
    Silent,
}

pub(crate) type Handler = dyn Fn(&str, &Value) -> Reply + Send + Sync;

/// A server on a free local port answering every request by `handler(path, body)`; the
/// number of requests it has had.
pub(crate) fn serve(handler: Arc<Handler>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let counted = count.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            counted.fetch_add(1, Ordering::SeqCst);
            let handler = handler.clone();
            std::thread::spawn(move || answer(stream, &*handler));
        }
    });
    (url, count)
}

fn answer(mut stream: TcpStream, handler: &Handler) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let mut length = 0;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).unwrap();
        if header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).unwrap();
    let body: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    match handler(&path, &body) {
        Reply::Answer(status, text) => {
            let _ = write!(
                stream,
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
        }
        Reply::Silent => std::thread::sleep(Duration::from_secs(60)),
    }
}

pub(crate) const MODELS: &str = r#"{"object":"list","data":[{"id":"served","object":"model"}]}"#;

/// A handler that lists the model and answers completions with `completion`.
pub(crate) fn completions(
    completion: impl Fn(&Value) -> Reply + Send + Sync + 'static,
) -> Arc<Handler> {
    Arc::new(move |path, body| match path {
        "/v1/models" => Reply::Answer(200, MODELS.into()),
        "/v1/completions" => completion(body),
        _ => Reply::Answer(404, r#"{"error":{"message":"not found"}}"#.into()),
    })
}

pub(crate) const TOKENS: [u32; 5] = [1, 5, 9, 14, 3];

/// The tiny model and its reference logits on [`TOKENS`] (`[positions, vocab]`), the vocab.
pub(crate) fn model_and_logits(dir: &Path) -> (std::path::PathBuf, Vec<f32>, usize) {
    let model = dir.join("tiny.gguf");
    common::synth_tiny(&model, &[]);
    let (logits, vocab) = logits_of(&model, dir, &[]);
    (model, logits, vocab)
}

/// `glmcheck run` of `model` on [`TOKENS`] with `extra` arguments: its logits, the vocab.
pub(crate) fn logits_of(model: &Path, dir: &Path, extra: &[&str]) -> (Vec<f32>, usize) {
    let trace = dir.join(format!("r{}.trace", extra.join("").replace(['-', '='], "")));
    let ids: Vec<String> = TOKENS.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let mut args = vec![
        "run",
        model.to_str().unwrap(),
        "--tokens",
        &ids,
        "--latent-norm-eps",
        "1e-5",
        "--out",
        trace.to_str().unwrap(),
    ];
    args.extend(extra);
    common::glmcheck_ok(&args);
    let trace = glmcheck::trace::Trace::open(&trace).unwrap();
    let (logits, shape) = glmcheck::compare::stage_diff::whole_values(&trace, "logits")
        .unwrap()
        .unwrap();
    (logits, shape[1] as usize)
}

/// vLLM's answer as it would give it for these logits: each prompt position's top `k` and the
/// prompt's own token, the last position's top `k` as the generated token's.
pub(crate) fn vllm_answer(logits: &[f32], vocab: usize, k: usize) -> Value {
    let top = |row: usize, extra: Option<u32>| -> Vec<(u32, f64)> {
        let r = &logits[row * vocab..(row + 1) * vocab];
        let max = r.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = r.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
        let mut ids: Vec<u32> = (0..vocab as u32).collect();
        ids.sort_by(|&a, &b| r[b as usize].total_cmp(&r[a as usize]));
        let mut keep: Vec<u32> = ids[..k].to_vec();
        keep.extend(extra.filter(|e| !keep.contains(e)));
        keep.iter()
            .map(|&i| (i, r[i as usize] as f64 - lse))
            .collect()
    };
    let mut prompt = vec![Value::Null];
    for (i, &t) in TOKENS.iter().enumerate().skip(1) {
        let entries: serde_json::Map<String, Value> = top(i - 1, Some(t))
            .into_iter()
            .map(|(id, lp)| {
                (
                    id.to_string(),
                    json!({"logprob": lp, "rank": 1, "decoded_token": null}),
                )
            })
            .collect();
        prompt.push(Value::Object(entries));
    }
    let last = top(TOKENS.len() - 1, None);
    let generated: serde_json::Map<String, Value> = last
        .iter()
        .map(|(id, lp)| (format!("token_id:{id}"), json!(lp)))
        .collect();
    json!({"id": "cmpl-1", "object": "text_completion", "model": "served", "choices": [{
        "index": 0, "text": "", "finish_reason": "length",
        "logprobs": {"text_offset": [0], "token_logprobs": [last[0].1],
                     "tokens": [format!("token_id:{}", last[0].0)], "top_logprobs": [generated]},
        "token_ids": [last[0].0], "prompt_logprobs": prompt, "prompt_token_ids": TOKENS}]})
}

pub(crate) fn endpoint(url: &str, model: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "endpoint",
        url,
        model.to_str().unwrap(),
        "--tokens",
        "1,5,9,14,3",
        "--max-tokens",
        "1",
        "--top-k",
        "4",
    ];
    args.extend(extra);
    common::glmcheck_output(&args)
}

#[test]
fn a_server_that_agrees_passes_and_one_that_parts_is_named_at_its_position() {
    let dir = common::scratch();
    let (model, logits, vocab) = model_and_logits(dir.path());
    let honest = vllm_answer(&logits, vocab, 4);
    let (url, _) = serve(completions(move |body| {
        assert_eq!(body["prompt"], json!(TOKENS));
        assert_eq!(
            (
                body["prompt_logprobs"].as_u64(),
                body["temperature"].as_u64()
            ),
            (Some(4), Some(0))
        );
        Reply::Answer(200, honest.to_string())
    }));
    let out = endpoint(&url, &model, &["--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verdict"], "pass");
    assert_eq!(report["served_model"], "served");
    let c = &report["prompts"][0]["comparison"];
    assert_eq!(c["positions"], 5);
    assert_eq!(c["top1_agreement"], 1.0);
    assert!(c["max_abs_delta_logprob"].as_f64().unwrap() < 1e-4, "{c}");

    // Position 2's distribution (the one predicting token 3 of the prompt) moved: its listed
    // log-probabilities reversed, so the top-1 is another token.
    let mut parted = vllm_answer(&logits, vocab, 4);
    let row = parted["choices"][0]["prompt_logprobs"][3]
        .as_object_mut()
        .unwrap();
    let mut values: Vec<Value> = row.values().cloned().collect();
    values.reverse();
    for (v, new) in row.values_mut().zip(values) {
        *v = new;
    }
    let (url, _) = serve(completions(move |_| Reply::Answer(200, parted.to_string())));
    let out = endpoint(&url, &model, &["--json"]);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verdict"], "fail");
    let c = &report["prompts"][0]["comparison"];
    assert_eq!(c["first_parting"]["position"], 2, "{c}");
    let problems = report["problems"].as_array().unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap().contains("first at position 2")),
        "{report}"
    );
    let text = endpoint(&url, &model, &[]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("FAIL: prompt 1: parts from the reference"),
        "{text}"
    );
}

/// A server whose answers are the tiny model's with a catalogued fault planted (`rope-neox`,
/// then `unsharded-column=kv_b` at TP 2): `--explain` ranks that fault first, far below the
/// clean model; an honest server has nothing to explain.
#[test]
fn explain_names_the_fault_planted_in_the_server() {
    let dir = common::scratch();
    let (model, clean_logits, vocab) = model_and_logits(dir.path());
    let explain = |logits: &[f32], extra: &[&str], code: i32| -> Value {
        let answer = vllm_answer(logits, vocab, 4);
        let (url, _) = serve(completions(move |_| Reply::Answer(200, answer.to_string())));
        let mut args = vec!["--explain", "--json"];
        args.extend(extra);
        let out = endpoint(&url, &model, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{stderr}");
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        report["explanation"].clone()
    };

    let (rope, _) = logits_of(&model, dir.path(), &["--inject", "rope-neox"]);
    let e = explain(&rope, &[], 1);
    assert_eq!(e["verdict"], "explained", "{e:#}");
    assert_eq!(e["best"]["name"], "rope-neox", "{e:#}");
    // Measured: rope-neox 0, clean 0.199 (indexer-rope-neox ties it: five tokens are fewer
    // than the indexer keeps), router-softmax 0.243.
    assert!(e["best"]["score"].as_f64().unwrap() < 1e-4, "{e:#}");
    let clean = common::explain_score(&e, "clean");
    assert!(clean > 0.1, "{e:#}");
    assert!(e["runner_up"]["score"].as_f64().unwrap() > 0.1, "{e:#}");
    assert_eq!(e["clean_score"], clean);
    assert_eq!(e["tp"], 1);
    let notes = e["not_tried"].to_string();
    assert!(
        notes.contains("unsharded-column") && notes.contains("--tp was not given"),
        "{notes}"
    );

    // At TP 2 the story's fault is tried first; a budget of 3 runs stops after clean and two
    // faults, and says what it left out.
    let (kv_b, _) = logits_of(
        &model,
        dir.path(),
        &["--tp", "2", "--inject", "unsharded-column=kv_b"],
    );
    // Measured: unsharded-column=kv_b 0, unsharded-column=q_b 0.512, clean 0.693.
    let e = explain(&kv_b, &["--tp", "2"], 1);
    assert_eq!(e["best"]["name"], "unsharded-column=kv_b", "{e:#}");
    assert_eq!(e["verdict"], "explained", "{e:#}");
    assert!(e["best"]["score"].as_f64().unwrap() < 1e-4, "{e:#}");
    assert!(e["runner_up"]["score"].as_f64().unwrap() > 0.25, "{e:#}");
    assert!(common::explain_score(&e, "clean") > 0.5, "{e:#}");
    let e = explain(&kv_b, &["--tp", "2", "--budget", "3"], 1);
    assert_eq!(e["ranking"].as_array().unwrap().len(), 3, "{e:#}");
    assert_eq!(e["best"]["name"], "unsharded-column=kv_b", "{e:#}");
    assert!(
        e["not_tried"].to_string().contains("past --budget 3"),
        "{e:#}"
    );

    // Nothing planted: nothing to explain, nothing run.
    let e = explain(&clean_logits, &["--tp", "2"], 0);
    assert_eq!(e["verdict"], "nothing_to_explain", "{e:#}");
    assert_eq!(e["ranking"], json!([]));

    // Bad input: one line, exit 2.
    let (url, _) = serve(completions(|_| Reply::Answer(500, "{}".into())));
    cannot_tell(
        &url,
        &model,
        &["--explain", "--budget", "1"],
        "--budget: at least 2 runs",
        Duration::from_secs(60),
    );
    cannot_tell(
        &url,
        &model,
        &["--explain", "--tp", "3"],
        "--tp 3: ",
        Duration::from_secs(60),
    );
}

/// `glmcheck endpoint` that must end with exit 2 and one line starting with `expected`, within
/// `within`.
fn cannot_tell(url: &str, model: &Path, extra: &[&str], expected: &str, within: Duration) {
    let began = Instant::now();
    let out = endpoint(url, model, extra);
    let took = began.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!("glmcheck: error: {expected}")),
        "{stderr}"
    );
    assert!(took < within, "{took:?}: {stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn servers_that_cannot_be_judged_end_with_one_line_and_exit_2() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    common::synth_tiny(&model, &[]);
    let minute = Duration::from_secs(60);

    // A 5xx is tried again (twice, after 0.5 and 1 s), then named.
    let (url, count) = serve(Arc::new(|_, _| {
        Reply::Answer(
            500,
            r#"{"error":{"message":"EngineCore encountered an issue"}}"#.into(),
        )
    }));
    cannot_tell(
        &url,
        &model,
        &[],
        &format!("{url}/v1/models: HTTP 500: EngineCore encountered an issue"),
        minute,
    );
    assert_eq!(count.load(Ordering::SeqCst), 3);

    // A 4xx is not.
    let (url, count) = serve(completions(|_| {
        Reply::Answer(
            400,
            r#"{"error":{"message":"prompt_logprobs: too many"}}"#.into(),
        )
    }));
    cannot_tell(
        &url,
        &model,
        &[],
        &format!("{url}/v1/completions: HTTP 400: prompt_logprobs: too many"),
        minute,
    );
    // /v1/models, /props (which API: a 404 is not llama-server) and /v1/completions once.
    assert_eq!(count.load(Ordering::SeqCst), 3);

    let (url, _) = serve(completions(|_| {
        Reply::Answer(200, "<html>hello</html>".into())
    }));
    cannot_tell(
        &url,
        &model,
        &[],
        &format!("{url}/v1/completions: not a completion answer"),
        minute,
    );

    let (url, _) = serve(Arc::new(|_, _| Reply::Answer(200, "[]".into())));
    cannot_tell(
        &url,
        &model,
        &[],
        &format!("{url}/v1/models: data[0].id: no model listed"),
        minute,
    );

    let (url, _) = serve(completions(|_| {
        Reply::Answer(
            200,
            r#"{"choices":[{"index":0,"text":"","token_ids":[4]}]}"#.into(),
        )
    }));
    cannot_tell(
        &url,
        &model,
        &[],
        &format!("{url}/v1/completions: choices[0].prompt_logprobs: no prompt log-probabilities"),
        minute,
    );

    let (url, _) = serve(completions(|_| {
        Reply::Answer(
            200,
            r#"{"choices":[{"prompt_token_ids":[1,5,9,15,3],"prompt_logprobs":[null]}]}"#.into(),
        )
    }));
    cannot_tell(&url, &model, &[], &format!("{url}/v1/completions: prompt_token_ids[3] is 15 where 14 was sent: the server did not take the token ids as sent"), minute);

    // Silence: the whole exchange ends at --timeout.
    let (url, _) = serve(Arc::new(|_, _| Reply::Silent));
    cannot_tell(
        &url,
        &model,
        &["--timeout", "2"],
        &format!("{url}/v1/models: no answer within 2 s (--timeout)"),
        Duration::from_secs(10),
    );
    let (url, _) = serve(completions(|_| Reply::Silent));
    cannot_tell(
        &url,
        &model,
        &["--timeout", "2"],
        &format!("{url}/v1/completions: no answer within 2 s (--timeout)"),
        Duration::from_secs(10),
    );

    // Nothing listening: refused, tried again, named.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    cannot_tell(&url, &model, &[], &format!("{url}/v1/models: "), minute);

    // Bad input, before any call.
    cannot_tell(
        "https://example.invalid",
        &model,
        &[],
        "https://example.invalid: not a plain http:// URL",
        minute,
    );
    cannot_tell(
        "http://127.0.0.1:1",
        &dir.path().join("none.gguf"),
        &[],
        "",
        minute,
    );
}

/// A server that allows fewer log-probabilities than asked (vLLM's `--max-logprobs`) refuses
/// with its cap; it is asked again at the cap, and the report says so.
#[test]
fn a_server_capping_log_probabilities_is_asked_again_at_its_cap() {
    let dir = common::scratch();
    let (model, logits, vocab) = model_and_logits(dir.path());
    let capped = vllm_answer(&logits, vocab, 3);
    let (url, count) = serve(completions(move |body| {
        match body["prompt_logprobs"].as_u64() {
            Some(k) if k > 3 => Reply::Answer(
                400,
                format!(
                    r#"{{"error":{{"message":"Requested prompt logprobs of {k}, which is greater than max allowed: 3","code":400}}}}"#
                ),
            ),
            _ => Reply::Answer(200, capped.to_string()),
        }
    }));
    let out = endpoint(&url, &model, &["--json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (report["top_k"].as_u64(), report["top_k_served"].as_u64()),
        (Some(4), Some(3))
    );
    // /v1/models, /props, the refused request and the one at the cap.
    assert_eq!(count.load(Ordering::SeqCst), 4);
    let text = endpoint(&url, &model, &[]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(
            "note: the server gives at most 3 log-probabilities per position (--top-k 4 asked)"
        ),
        "{text}"
    );
}
