//! The reference executor against transformers' own class of every other member of the
//! MLA/MoE family, each exercising switches GLM-5's class never takes: NeoX-half RoPE in MLA
//! (`rope_interleave: false`), YaRN frequencies, cos/sin scale and softmax mscale, dense
//! attention without an indexer (DeepSeek-V3), an indexer that rotates NeoX halves
//! (DeepSeek-V3.2, 16 heads so that scores have no exact ties, sequence longer than
//! `index_topk`), softmax routing without a correction bias, greedy or limited to the groups with
//! the best single score (DeepSeek-V2), `q_proj` without q LoRA (V2-Lite), Kimi-K2's
//! `model_type` on DeepSeek-V3's class with one group, and GLM-4.7-Flash's `mlp_layer_types`.
//! On each: logits within 1e-4 × max|logit|, the same top-1 at every position, 16 identical
//! greedy tokens. Beyond these hand-picked members, configs drawn at random per class (sizes,
//! head dims, layers, experts and groups, routing switches, RoPE layout, theta and YaRN, V3.2's
//! indexer) from fixed seeds must agree too, so that no field the tests never set goes unread.

use crate::common;

use glmcheck::trace::Trace;
use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const TOKENS: &str = "1,7,42,300,5,99,123,64,17,250,3,8";

/// transformers' float32 logits of `tokens` on `model` (`hf.logits`), and the vocabulary size.
pub(crate) fn hf_logits(model: &std::path::Path, tokens: &str) -> (Vec<f32>, usize) {
    let theirs: Value = serde_json::from_str(&common::run_oracle(
        "hf.logits",
        &[model.to_str().unwrap(), tokens],
    ))
    .unwrap();
    let y = theirs["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    (y, theirs["shape"][1].as_u64().unwrap() as usize)
}

/// Our logits `x` within 1e-4 × max|logit| of transformers' `y` at every position.
pub(crate) fn assert_logits_agree(what: &str, x: &[f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "{what}");
    let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = x.iter().zip(y).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(err <= 1e-4 * scale, "{what}: max |Δlogit| {err} of {scale}");
}

/// Our trace of the model transformers agreed with, and the model (alive while this is).
struct Agreed {
    trace: Trace,
    model: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// Build `arch` with transformers into `dir/model`, run both sides and compare; every failure
/// names the config it ran.
fn agrees_with_transformers(arch: &str, flags: &[&str]) -> Agreed {
    let dir = common::scratch();
    let model = dir.path().join("model");
    let model_s = model.to_str().unwrap();
    let mut args = vec![model_s, arch];
    args.extend(flags);
    common::run_oracle("hf.deepseek_model", &args);
    let what = format!("{arch} {flags:?} {}", config_values(&model));

    let trace_dir = dir.path().join("ours.trace");
    let out = common::glmcheck_output(&[
        "run",
        model_s,
        "--tokens",
        TOKENS,
        "--generate",
        "16",
        "--json",
        "--out",
        trace_dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{what}: glmcheck run exits {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    let ours: Value = serde_json::from_slice(&out.stdout).unwrap();
    let trace = Trace::open(&trace_dir).unwrap();
    let x = trace.tensor("logits", None).unwrap().unwrap();
    let (y, vocab) = hf_logits(&model, TOKENS);
    assert_logits_agree(&what, &x, &y);
    let argmax = |v: &[f32]| -> Vec<usize> {
        v.chunks_exact(vocab)
            .map(|row| {
                (0..vocab)
                    .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
                    .unwrap()
            })
            .collect()
    };
    assert_eq!(argmax(&x), argmax(&y), "{what}: top-1 per position");
    let generated: Value =
        serde_json::from_str(&common::run_oracle("hf.generate", &[model_s, TOKENS, "16"])).unwrap();
    assert_eq!(ours["generated"], generated, "{what}: 16 greedy tokens");
    Agreed {
        trace,
        model,
        _dir: dir,
    }
}

/// The saved config.json on one line, less the keys no forward reads, to name a failing config.
fn config_values(model: &std::path::Path) -> String {
    let text = std::fs::read_to_string(model.join("config.json")).unwrap();
    let mut cfg: serde_json::Map<String, Value> = serde_json::from_str(&text).unwrap();
    for k in [
        "architectures",
        "attention_dropout",
        "bos_token_id",
        "dtype",
        "eos_token_id",
        "initializer_range",
        "output_router_logits",
        "pad_token_id",
        "pretraining_tp",
        "transformers_version",
        "use_cache",
    ] {
        cfg.remove(k);
    }
    Value::Object(cfg).to_string()
}

/// The member `glmcheck inspect` names the folder, and the switches it lists as unlike GLM-5.
fn inspected(model: &std::path::Path) -> (String, Vec<String>) {
    let j = common::glmcheck_json(["inspect", model.to_str().unwrap(), "--json"], 0);
    assert_eq!(j["schema"]["ok"], true, "{}", j["schema"]);
    let names = j["family"]["differences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect();
    (j["family"]["member"].as_str().unwrap().to_string(), names)
}

#[test]
fn deepseek_v3_neox_rope_with_yarn_agrees_with_transformers() {
    let run = agrees_with_transformers("v3", &["--neox", "--yarn"]);
    assert!(
        run.trace.stage("L0.attn.index_topk", None).is_none(),
        "DeepSeek-V3 attends densely: no DSA selection"
    );
}

#[test]
fn deepseek_v3_interleaved_rope_agrees_with_transformers() {
    agrees_with_transformers("v3", &[]);
}

#[test]
fn deepseek_v32_neox_indexer_agrees_with_transformers() {
    let run = agrees_with_transformers("v32", &["--yarn"]);
    let stage = run.trace.stage("L2.attn.index_topk", None).unwrap();
    assert_eq!(stage.shape, vec![12, 4], "index_topk 4 of 12 positions");
}

#[test]
fn deepseek_v2_softmax_routing_limited_to_the_best_groups_agrees_with_transformers() {
    let run = agrees_with_transformers("v2", &["--yarn"]);
    let (member, unlike) = inspected(&run.model);
    assert_eq!(member, "deepseek_v2");
    for switch in [
        "scoring",
        "topk_method",
        "correction_bias",
        "norm_topk_prob",
    ] {
        assert!(unlike.iter().any(|u| u == switch), "{switch} in {unlike:?}");
    }
}

#[test]
fn deepseek_v2_lite_without_q_lora_agrees_with_transformers() {
    let run = agrees_with_transformers("v2-lite", &[]);
    assert!(
        run.trace.stage("L0.attn.q_a", None).is_none(),
        "no q LoRA: q_proj reads the normed hidden state"
    );
    assert!(run.trace.stage("L0.attn.q", None).is_some());
    let (member, unlike) = inspected(&run.model);
    assert_eq!(member, "deepseek_v2");
    assert!(unlike.iter().any(|u| u == "query"), "{unlike:?}");
}

#[test]
fn kimi_k2_on_deepseek_v3s_class_agrees_with_transformers() {
    let run = agrees_with_transformers("kimi-k2", &["--yarn"]);
    let (member, _) = inspected(&run.model);
    assert_eq!(member, "kimi_k2");
}

#[test]
fn glm_4_7_flash_dense_then_sparse_layers_agrees_with_transformers() {
    let run = agrees_with_transformers("glm-4.7-flash", &[]);
    assert!(
        run.trace.stage("L0.moe.router_logits", None).is_none(),
        "L0 dense"
    );
    assert!(
        run.trace.stage("L1.moe.router_logits", None).is_some(),
        "L1 sparse"
    );
    let (member, unlike) = inspected(&run.model);
    assert_eq!(member, "glm4_moe_lite");
    assert_eq!(
        unlike,
        ["attention", "indexer_rope", "expert_groups"],
        "GLM-5 without DSA, in the oracle's two groups"
    );
}

/// Seeds of `hf.deepseek_model --random` per class, picked so that together they cover both
/// sides of every drawn switch (YaRN and its mscales, q LoRA or none, 0–2 shared experts, no
/// leading dense layer, group limits, normalised or raw weights, v ≠ nope, V2's two top-k
/// methods, NeoX or interleaved RoPE, V3.2's indexer top-k below and above the sequence).
/// V3.2's seed 1 draws `rope_interleave` false, which its class never reads.
const RANDOM_SEEDS: [(&str, [u64; 4]); 6] = [
    ("v2", [1, 4, 5, 10]),
    ("v2-lite", [0, 2, 3, 6]),
    ("v3", [1, 3, 4, 16]),
    ("v32", [1, 10, 22, 34]),
    ("kimi-k2", [1, 3, 6, 16]),
    ("glm-4.7-flash", [1, 3, 4, 16]),
];

#[test]
fn random_configs_of_every_class_agree_with_transformers() {
    let cases: Vec<(&str, u64)> = RANDOM_SEEDS
        .iter()
        .flat_map(|&(arch, seeds)| seeds.map(|seed| (arch, seed)))
        .collect();
    // Each case is three Python start-ups: run them side by side, every failure collected.
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                while let Some(&(arch, seed)) = cases.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let seed = seed.to_string();
                    let run = std::panic::catch_unwind(|| {
                        agrees_with_transformers(arch, &["--random", &seed]);
                    });
                    if let Err(panic) = run {
                        let msg = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        failures.lock().unwrap().push(msg);
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} random configs disagree with transformers:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Keys a config.json may carry that the classes read their own way: V3.2's MLA turns
/// interleaved pairs whatever `rope_interleave` says, no class but V2's reads `scoring_func`
/// (V2 softmax, the others sigmoid), and V3.2 builds each layer's MLP from `mlp_layer_types`.
#[test]
fn keys_the_classes_read_their_own_way_agree_with_transformers() {
    agrees_with_transformers("v32", &["--neox"]);
    agrees_with_transformers("v3", &["--set", r#"scoring_func="softmax""#]);
    agrees_with_transformers("v2", &["--set", r#"scoring_func="sigmoid""#]);
    agrees_with_transformers(
        "v32",
        &["--set", r#"mlp_layer_types=["dense","dense","sparse"]"#],
    );
}
