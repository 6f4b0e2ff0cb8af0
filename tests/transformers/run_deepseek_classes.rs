//! The reference executor against transformers' DeepSeek MLA classes, which exercise the paths
//! its GLM-5 class never takes: NeoX-half RoPE in MLA (`rope_interleave: false`), YaRN
//! frequencies, cos/sin scale and softmax mscale, dense attention without an indexer
//! (DeepSeek-V3), and an indexer that rotates NeoX halves (DeepSeek-V3.2, 16 heads so that
//! scores have no exact ties, sequence longer than `index_topk`). On each: logits within
//! 1e-4 × max|logit|, the same top-1 at every position, 16 identical greedy tokens.

use crate::common;

use glmcheck::trace::Trace;
use serde_json::Value;

const TOKENS: &str = "1,7,42,300,5,99,123,64,17,250,3,8";

/// Build `arch` with transformers into `dir/model`, run both sides and compare.
fn agrees_with_transformers(arch: &str, flags: &[&str]) -> Trace {
    let dir = common::scratch();
    let model = dir.path().join("model");
    let model_s = model.to_str().unwrap();
    let mut args = vec![model_s, arch];
    args.extend(flags);
    common::run_oracle("hf.deepseek_model", &args);

    let trace_dir = dir.path().join("ours.trace");
    let ours = common::glmcheck_json(
        [
            "run",
            model_s,
            "--tokens",
            TOKENS,
            "--generate",
            "16",
            "--json",
            "--out",
            trace_dir.to_str().unwrap(),
        ],
        0,
    );
    let trace = Trace::open(&trace_dir).unwrap();
    let x = trace.tensor("logits", None).unwrap().unwrap();
    let theirs: Value =
        serde_json::from_str(&common::run_oracle("hf.logits", &[model_s, TOKENS])).unwrap();
    let y: Vec<f32> = theirs["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(x.len(), y.len());
    let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = x
        .iter()
        .zip(&y)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= 1e-4 * scale,
        "{arch} {flags:?}: max |Δlogit| {err} of {scale}"
    );
    let vocab = theirs["shape"][1].as_u64().unwrap() as usize;
    let argmax = |v: &[f32]| -> Vec<usize> {
        v.chunks_exact(vocab)
            .map(|row| {
                (0..vocab)
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(
        argmax(&x),
        argmax(&y),
        "{arch} {flags:?}: top-1 per position"
    );
    let generated: Value =
        serde_json::from_str(&common::run_oracle("hf.generate", &[model_s, TOKENS, "16"])).unwrap();
    assert_eq!(
        ours["generated"], generated,
        "{arch} {flags:?}: 16 greedy tokens"
    );
    trace
}

#[test]
fn deepseek_v3_neox_rope_with_yarn_agrees_with_transformers() {
    let trace = agrees_with_transformers("v3", &["--neox", "--yarn"]);
    assert!(
        trace.stage("L0.attn.index_topk", None).is_none(),
        "DeepSeek-V3 attends densely: no DSA selection"
    );
}

#[test]
fn deepseek_v3_interleaved_rope_agrees_with_transformers() {
    agrees_with_transformers("v3", &[]);
}

#[test]
fn deepseek_v32_neox_indexer_agrees_with_transformers() {
    let trace = agrees_with_transformers("v32", &["--yarn"]);
    let stage = trace.stage("L2.attn.index_topk", None).unwrap();
    assert_eq!(stage.shape, vec![12, 4], "index_topk 4 of 12 positions");
}
