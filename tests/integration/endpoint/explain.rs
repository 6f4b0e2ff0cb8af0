//! `glmcheck endpoint --explain` beyond the catalogue's defaults, against the tiny HTTP server of
//! `mod.rs`: a server whose loader read a config key wrong (the model served with another
//! value of one key) is explained by that key's misread, and one whose all-reduce is left out
//! at one layer only by that layer's hypothesis.

use serde_json::Value;

use super::{completions, endpoint, logits_of, serve, vllm_answer, Reply};
use crate::common;

/// The explanation of a server answering with `logits`, run against `model` with `extra`.
fn explanation(model: &std::path::Path, logits: &[f32], vocab: usize, extra: &[&str]) -> Value {
    let answer = vllm_answer(logits, vocab, 4);
    let (url, _) = serve(completions(move |_| Reply::Answer(200, answer.to_string())));
    let mut args = vec!["--explain", "--json"];
    args.extend(extra);
    let out = endpoint(&url, model, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{stderr} {:#}",
        report["prompts"][0]["comparison"]
    );
    report["explanation"].clone()
}

/// The best hypothesis is `name`, explained, far below clean and the runner-up.
fn assert_explained_by(e: &Value, name: &str) {
    assert_eq!(e["best"]["name"], name, "{e:#}");
    assert_eq!(e["verdict"], "explained", "{e:#}");
    let best = e["best"]["score"].as_f64().unwrap();
    assert!(best < 1e-4, "{e:#}");
    assert!(
        e["runner_up"]["score"].as_f64().unwrap() > 100.0 * best.max(1e-4),
        "{e:#}"
    );
    assert!(
        common::explain_score(e, "clean") > 100.0 * best.max(1e-4),
        "{e:#}"
    );
}

#[test]
fn a_config_key_read_wrong_is_named_by_its_misread() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    common::synth_tiny(&model, &[]);
    for (set, name) in [
        ("rope_theta=10000", "config rope_theta=10000"),
        ("routed_scaling_factor=1", "config routed_scaling_factor=1"),
    ] {
        // The same weights (the synthesis is seeded), one key changed: what a server whose
        // loader read that key so computes.
        let served = dir.path().join(format!("{}.gguf", set.replace('=', "-")));
        common::synth_tiny(&served, &["--set", set]);
        let traces = dir.path().join(set.replace('=', "-"));
        std::fs::create_dir(&traces).unwrap();
        let (logits, vocab) = logits_of(&served, &traces, &[]);
        // An f32 server is held to 0.05 nats: rope_theta's move on five tokens (0.45) is
        // within the bf16 default.
        let e = explanation(&model, &logits, vocab, &["--kv-type", "f32"]);
        assert_explained_by(&e, name);
    }
}

#[test]
fn an_all_reduce_left_out_at_one_layer_is_named_with_its_layer() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    common::synth_tiny(&model, &[]);
    let (logits, vocab) = logits_of(
        &model,
        dir.path(),
        &["--tp", "2", "--inject", "skip-all-reduce=1"],
    );
    let e = explanation(&model, &logits, vocab, &["--tp", "2"]);
    assert_explained_by(&e, "skip-all-reduce=1");
    let names: Vec<&str> = e["ranking"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["name"].as_str().unwrap())
        .collect();
    // Every layer of each layer-taking fault, but nan-expert's default layer (1, the first
    // MoE layer) and the dense layer 0 where there is no expert.
    for n in [
        "skip-all-reduce=0",
        "skip-all-reduce=2",
        "double-all-reduce=1",
        "nan-expert=2",
    ] {
        assert!(names.contains(&n), "{n}: {names:?}");
    }
    for n in ["nan-expert=0", "nan-expert=1"] {
        assert!(!names.contains(&n), "{n}: {names:?}");
    }
}
