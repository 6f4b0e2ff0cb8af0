//! The CPU reference executor against transformers, on four synthetic GLM-5 configs (DSA active,
//! group-limited routing, two leading dense layers, GLM-5.2 shared indexer layers), all with 16
//! indexer heads so that DSA scores have no exact ties: every stage both sides record has cosine
//! ≥ 0.999999 and lies within f32 summation-order noise, expert and DSA selections are the same
//! sets, logits differ by at most 1e-4 × max|logit|, the top-1 token agrees at every position,
//! and 16 greedily generated tokens are identical. The GGUF form of the same weights gives the
//! very same trace, and so does a run on another thread count.

use crate::common;

use std::path::Path;
use std::process::Command;

use glmcheck::trace::{ElemType, Trace};

/// Longer than the tiny preset's `index_topk` (4), so the indexer really selects.
const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

/// Relative max error allowed between two f32 computations of one stage that add in different
/// orders: transformers' and ours agree to about 1e-6 on these models.
const F32_NOISE: f64 = 1e-5;

/// `cmd` run to its end, which must succeed.
fn succeeded(cmd: &mut Command) -> std::process::Output {
    let run = cmd.output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    run
}

fn glmcheck(args: &[&str], out: &Path) {
    succeeded(Command::new(common::glmcheck_bin()).args(args).arg(out));
}

fn run_ours(model: &Path, out: &Path) -> Trace {
    let model = model.to_str().unwrap();
    glmcheck(
        &["run", model, "--tokens", TOKENS, "--full", "**", "--out"],
        out,
    );
    Trace::open(out).unwrap()
}

fn run_probe(hf: &Path, out: &Path) -> Trace {
    let run = Command::new(common::python())
        .args(["-m", "glmcheck_probe.transformers_probe"])
        .arg(hf)
        .args(["--tokens", TOKENS, "--full", "**", "--out"])
        .arg(out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    Trace::open(out).unwrap()
}

/// Rows of an id stage as sorted sets (transformers' router top-k is unsorted).
fn id_sets(trace: &Trace, name: &str, width: usize) -> Vec<Vec<i32>> {
    let ids = trace.tensor_i32(name, None).unwrap().unwrap();
    ids.chunks(width)
        .map(|r| {
            let mut r = r.to_vec();
            r.sort_unstable();
            r
        })
        .collect()
}

/// Cosine similarity of two vectors, in f64.
fn cosine(x: &[f32], y: &[f32]) -> f64 {
    let dot: f64 = x
        .iter()
        .zip(y)
        .map(|(a, b)| f64::from(*a) * f64::from(*b))
        .sum();
    let norm = |v: &[f32]| v.iter().map(|a| f64::from(*a).powi(2)).sum::<f64>().sqrt();
    if norm(x) == 0.0 && norm(y) == 0.0 {
        return 1.0;
    }
    dot / (norm(x) * norm(y))
}

fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<usize> {
    logits
        .chunks(vocab)
        .map(|r| (0..vocab).fold(0, |b, i| if r[i] > r[b] { i } else { b }))
        .collect()
}

fn compare_with_transformers(dir: &Path, sets: &[&str]) {
    let hf = dir.join("hf");
    let mut args = vec![
        "synth",
        "--format",
        "hf",
        "--seed",
        "11",
        "--set",
        "index_n_heads=16",
    ];
    for s in sets {
        args.extend(["--set", s]);
    }
    args.push("--out");
    glmcheck(&args, &hf);
    let (ours, theirs) = (
        run_ours(&hf, &dir.join("ours.trace")),
        run_probe(&hf, &dir.join("hf.trace")),
    );
    let names = theirs.stage_names();
    assert!(
        names.len() > 50,
        "the probe records every layer's stages: {names:?}"
    );
    for name in names {
        let (a, b) = (
            ours.stage(name, None)
                .unwrap_or_else(|| panic!("{name} not recorded by glmcheck")),
            theirs.stage(name, None).unwrap(),
        );
        assert_eq!(a.shape, b.shape, "{name}");
        if a.dtype == ElemType::I32 {
            let width = *a.shape.last().unwrap() as usize;
            assert_eq!(
                id_sets(&ours, name, width),
                id_sets(&theirs, name, width),
                "{name}: selections differ"
            );
            continue;
        }
        let (x, y) = (
            ours.tensor(name, None).unwrap().unwrap(),
            theirs.tensor(name, None).unwrap().unwrap(),
        );
        let scale = y.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
        let err = x
            .iter()
            .zip(&y)
            .fold(0f64, |m, (a, b)| m.max(f64::from((a - b).abs())));
        assert!(
            err <= F32_NOISE * scale,
            "{name}: max |ours − transformers| = {err:e} against |x|max {scale}"
        );
        assert!(
            cosine(&x, &y) >= 0.999999,
            "{name}: cosine {}",
            cosine(&x, &y)
        );
    }
    let (x, y) = (
        ours.tensor("logits", None).unwrap().unwrap(),
        theirs.tensor("logits", None).unwrap().unwrap(),
    );
    let scale = y.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        x.iter().zip(&y).all(|(a, b)| (a - b).abs() <= 1e-4 * scale),
        "logits beyond 1e-4 × max|logit|"
    );
    let vocab = *ours.stage("logits", None).unwrap().shape.last().unwrap() as usize;
    assert_eq!(
        argmax_rows(&x, vocab),
        argmax_rows(&y, vocab),
        "top-1 at every position"
    );

    let run = Command::new(common::glmcheck_bin())
        .args([
            "run",
            hf.to_str().unwrap(),
            "--tokens",
            TOKENS,
            "--generate",
            "16",
            "--json",
            "--out",
        ])
        .arg(dir.join("gen.trace"))
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let ours: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let out = common::run_oracle("hf.generate", &[hf.to_str().unwrap(), TOKENS, "16"]);
    let theirs: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(ours["generated"], theirs, "16 greedy tokens");
}

#[test]
fn dsa_active_agrees_with_transformers() {
    compare_with_transformers(common::scratch().path(), &[]);
}

#[test]
fn group_limited_routing_agrees_with_transformers() {
    compare_with_transformers(common::scratch().path(), &["n_group=4", "topk_group=2"]);
}

#[test]
fn two_leading_dense_layers_agree_with_transformers() {
    compare_with_transformers(
        common::scratch().path(),
        &["first_k_dense_replace=2", "num_hidden_layers=4"],
    );
}

#[test]
fn shared_indexer_layers_agree_with_transformers() {
    compare_with_transformers(
        common::scratch().path(),
        &["index_topk_freq=2", "index_skip_topk_offset=1"],
    );
}

/// `glmcheck run MODEL ARGS --out DIR/NAME.trace` under the environment `env`: the trace and
/// what the run printed.
fn run_under(model: &Path, args: &[&str], env: &[(&str, &str)], out: &Path) -> (Trace, String) {
    let run = succeeded(
        Command::new(common::glmcheck_bin())
            .envs(env.iter().copied())
            .args(["run", model.to_str().unwrap(), "--tokens", TOKENS, "--json"])
            .args(args)
            .arg("--out")
            .arg(out),
    );
    let printed = String::from_utf8_lossy(&run.stdout).replace(&out.display().to_string(), "");
    (Trace::open(out).unwrap(), printed)
}

fn assert_same_stages(x: &Trace, y: &Trace) {
    assert_eq!(x.stages().len(), y.stages().len());
    for (x, y) in x.stages().iter().zip(y.stages()) {
        assert_eq!(
            (&x.name, x.rank, &x.stats),
            (&y.name, y.rank, &y.stats),
            "statistics and content hash"
        );
    }
}

#[test]
fn the_same_run_on_another_thread_count_gives_the_same_trace() {
    let dir = common::scratch();
    let gguf = dir.path().join("m.gguf");
    glmcheck(&["synth", "--quant", "q4_k_m", "--out"], &gguf);
    let out = |name: &str| dir.path().join(name);
    let (one, _) = run_under(&gguf, &[], &[("RAYON_NUM_THREADS", "1")], &out("t1.trace"));
    let (two, _) = run_under(&gguf, &[], &[("RAYON_NUM_THREADS", "2")], &out("t2.trace"));
    assert_same_stages(&one, &two);
}

#[test]
fn weights_kept_between_passes_change_no_value() {
    // A generation keeps the weights it holds for its later passes, within a budget: none
    // kept, a few kept (a budget of 256 KiB), all kept must give the same stages and tokens,
    // at TP 1 and 2 (each rank's shard kept apart), in f32 and bf16.
    let dir = common::scratch();
    let gguf = dir.path().join("m.gguf");
    glmcheck(&["synth", "--quant", "q4_k_m", "--out"], &gguf);
    for (tp, dtype) in [("1", "f32"), ("2", "bf16")] {
        let args = ["--generate", "4", "--tp", tp, "--dtype", dtype];
        let runs: Vec<(Trace, String)> = ["0", "0.00025", "4"]
            .iter()
            .map(|gib| {
                let out = dir.path().join(format!("tp{tp}-{dtype}-{gib}.trace"));
                run_under(&gguf, &args, &[("GLMCHECK_KEEP_WEIGHTS_GIB", gib)], &out)
            })
            .collect();
        for (trace, printed) in &runs[1..] {
            assert_same_stages(&runs[0].0, trace);
            assert_eq!(&runs[0].1, printed, "tokens generated");
        }
    }
}

#[test]
fn a_keeping_budget_that_is_no_number_is_a_one_line_error() {
    let dir = common::scratch();
    let gguf = dir.path().join("m.gguf");
    glmcheck(&["synth", "--out"], &gguf);
    let run = Command::new(common::glmcheck_bin())
        .env("GLMCHECK_KEEP_WEIGHTS_GIB", "lots")
        .args([
            "run",
            gguf.to_str().unwrap(),
            "--tokens",
            TOKENS,
            "--generate",
            "1",
        ])
        .arg("--out")
        .arg(dir.path().join("x.trace"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{err}");
    assert!(err.contains("GLMCHECK_KEEP_WEIGHTS_GIB=lots"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn gguf_and_hf_forms_give_the_same_trace() {
    let dir = common::scratch();
    let (hf, gguf) = (dir.path().join("hf"), dir.path().join("m.gguf"));
    glmcheck(&["synth", "--format", "hf", "--seed", "3", "--out"], &hf);
    glmcheck(&["synth", "--seed", "3", "--out"], &gguf);
    let (a, b) = (
        run_ours(&hf, &dir.path().join("a.trace")),
        run_ours(&gguf, &dir.path().join("b.trace")),
    );
    assert_eq!(a.stages().len(), b.stages().len());
    for (x, y) in a.stages().iter().zip(b.stages()) {
        assert_eq!(
            (&x.name, &x.stats),
            (&y.name, &y.stats),
            "stage statistics and content hash"
        );
    }
}

#[test]
fn token_ids_past_the_vocabulary_are_one_line_errors() {
    let dir = common::scratch();
    let gguf = dir.path().join("m.gguf");
    glmcheck(&["synth", "--out"], &gguf);
    let run = |args: &[&str]| {
        Command::new(common::glmcheck_bin())
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&[
        "run",
        gguf.to_str().unwrap(),
        "--tokens",
        "1,99999",
        "--out",
        dir.path().join("x.trace").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.lines().count() == 1 && err.contains("99999"), "{err}");
}

/// `--prompt` tokenizes as transformers' tokenizer does, on the GGUF (its `tokenizer.ggml.*`)
/// and the HF folder (its `tokenizer.json`), and the generated tokens decode as it decodes them.
#[test]
fn prompts_tokenize_and_generations_decode_as_transformers_does() {
    let dir = common::scratch();
    let (hf, gguf) = (dir.path().join("hf"), dir.path().join("m.gguf"));
    glmcheck(&["synth", "--format", "hf", "--out"], &hf);
    glmcheck(&["synth", "--out"], &gguf);
    let prompt = "The capital of France is";
    for (i, model) in [&hf, &gguf].into_iter().enumerate() {
        let run = Command::new(common::glmcheck_bin())
            .args([
                "run",
                model.to_str().unwrap(),
                "--prompt",
                prompt,
                "--generate",
                "8",
                "--json",
                "--out",
            ])
            .arg(dir.path().join(format!("{i}.trace")))
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let ours: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
        let generated: Vec<String> = ours["generated"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect();
        let out = common::run_oracle(
            "hf.encode_decode",
            &[hf.to_str().unwrap(), prompt, &generated.join(",")],
        );
        let theirs: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(ours["tokens"], theirs["ids"], "{}", model.display());
        assert_eq!(ours["text"], theirs["text"], "{}", model.display());
        assert!(
            ours["text"].as_str().unwrap().starts_with(" Paris."),
            "{}",
            ours["text"]
        );
    }
}

/// `glmcheck run` of `model` at `dtype` into `out`.
fn run_at(model: &Path, dtype: &str, out: &Path) -> Trace {
    glmcheck(
        &[
            "run",
            model.to_str().unwrap(),
            "--tokens",
            TOKENS,
            "--dtype",
            dtype,
            "--out",
        ],
        out,
    );
    Trace::open(out).unwrap()
}

fn logits_of(trace: &Trace) -> Vec<f64> {
    trace
        .tensor("logits", None)
        .unwrap()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

fn rms_diff(a: &[f64], b: &[f64]) -> f64 {
    (a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>() / a.len() as f64).sqrt()
}

/// The bf16 emulation is a noise envelope of the right size: its logits depart from the f32
/// reference by about as much as transformers' own bf16 run departs from f32.
#[test]
fn bf16_emulation_departs_from_f32_as_much_as_transformers_in_bf16() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    glmcheck(&["synth", "--format", "hf", "--seed", "11", "--out"], &hf);
    let run = |dtype: &str| {
        logits_of(&run_at(
            &hf,
            dtype,
            &dir.path().join(format!("{dtype}.trace")),
        ))
    };
    let (f32_logits, bf16_logits) = (run("f32"), run("bf16"));
    let npy = dir.path().join("hf_bf16.npy");
    common::run_oracle(
        "hf.logits_dtype",
        &[
            hf.to_str().unwrap(),
            TOKENS,
            "bfloat16",
            npy.to_str().unwrap(),
        ],
    );
    let bytes = std::fs::read(&npy).unwrap();
    // A float32 .npy: the header's length sits at bytes 8..10, the data follows it.
    let start = 10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let hf_bf16: Vec<f64> = bytes[start..]
        .chunks_exact(4)
        .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
        .collect();
    assert_eq!(hf_bf16.len(), f32_logits.len());
    let (ours, theirs) = (
        rms_diff(&bf16_logits, &f32_logits),
        rms_diff(&hf_bf16, &f32_logits),
    );
    assert!(
        ours > 0.0 && (0.5..=2.0).contains(&(ours / theirs)),
        "bf16 − f32: ours {ours}, transformers {theirs}"
    );
}

/// On a model made to leave fp16's range at layer 1, the f16 emulation without vLLM's residual
/// rescaling (`--inject fp16-overflow`) overflows exactly there, while f32, bf16 and the
/// rescaled f16 stay finite.
#[test]
fn f16_emulation_overflows_where_the_residual_leaves_the_fp16_range() {
    let dir = common::scratch();
    let gguf = dir.path().join("m.gguf");
    glmcheck(&["synth", "--fp16-overflow", "1", "--out"], &gguf);
    let inf_at = |dtype: &str, extra: &[&str]| -> Vec<(String, u64)> {
        let out = dir.path().join(format!("{dtype}{}.trace", extra.len()));
        let mut args = vec![
            "run",
            gguf.to_str().unwrap(),
            "--tokens",
            TOKENS,
            "--dtype",
            dtype,
        ];
        args.extend(extra);
        args.push("--out");
        glmcheck(&args, &out);
        Trace::open(&out)
            .unwrap()
            .stages()
            .iter()
            .filter(|s| s.stats.inf > 0)
            .map(|s| (s.name.clone(), s.stats.inf))
            .collect()
    };
    assert_eq!(inf_at("f32", &[]), vec![]);
    assert_eq!(inf_at("bf16", &[]), vec![]);
    assert_eq!(
        inf_at("f16", &[]),
        vec![],
        "rescaled by 1/routed_scaling_factor"
    );
    let f16 = inf_at("f16", &["--inject", "fp16-overflow"]);
    let first = &f16.first().expect("f16 without rescaling overflows").0;
    assert!(
        first.starts_with("L1."),
        "first Inf at {first}, expected in layer 1: {f16:?}"
    );
}

/// `--dtype f64` computes in f64: it agrees with transformers' f32 logits as the f32 reference
/// does, departs from the f32 run only by f32 rounding (yet does depart), and records f64.
#[test]
fn f64_reference_agrees_with_f32_to_f32_rounding() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    glmcheck(
        &[
            "synth",
            "--format",
            "hf",
            "--seed",
            "11",
            "--set",
            "index_n_heads=16",
            "--out",
        ],
        &hf,
    );
    let (f32_trace, f64_trace) = (
        run_at(&hf, "f32", &dir.path().join("f32.trace")),
        run_at(&hf, "f64", &dir.path().join("f64.trace")),
    );
    assert_eq!(f64_trace.manifest().dtype, "f64");
    assert!(f64_trace.stages().iter().all(|s| s.dtype != ElemType::F32));
    let (a, b) = (logits_of(&f32_trace), logits_of(&f64_trace));
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
    let err = a
        .iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(err > 0.0, "the f64 run computes in f64, not f32");
    assert!(err <= 1e-5 * scale, "f32 − f64: {err} of {scale}");
    let theirs: serde_json::Value = serde_json::from_str(&common::run_oracle(
        "hf.logits",
        &[hf.to_str().unwrap(), TOKENS],
    ))
    .unwrap();
    let hf_logits: Vec<f64> = theirs["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let err = b
        .iter()
        .zip(&hf_logits)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
    assert!(err <= 1e-4 * scale, "f64 − transformers: {err} of {scale}");
}

#[test]
fn a_trace_folder_in_use_is_named_once_in_a_one_line_error() {
    let dir = common::scratch();
    let gguf = dir.path().join("m.gguf");
    glmcheck(&["synth", "--out"], &gguf);
    let out = dir.path().join("used.trace");
    run_under(&gguf, &[], &[], &out);
    let again = Command::new(common::glmcheck_bin())
        .args(["run", gguf.to_str().unwrap(), "--tokens", TOKENS, "--out"])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(2), "{err}");
    assert_eq!(err.matches(&*out.display().to_string()).count(), 1, "{err}");
    assert!(err.contains("already holds files"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}
