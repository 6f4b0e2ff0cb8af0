//! glmcheck against llama.cpp (docs/design.md §10) and transformers on the same weights: a tiny random
//! `GlmMoeDsaForCausalLM` made and saved by transformers, converted to an F32 GGUF by llama.cpp's
//! own converter (`glmcheck_oracle.llamacpp.model`), then run by glmcheck, by llama.cpp
//! (`tests/oracle/llamacpp/dump_logits.cpp`: F32 K/V cache, flash attention off, the whole prompt
//! in one batch and one token at a time through its caches) and by transformers.
//!
//! At every position of every sequence — one no longer than `index_topk` (dense attention), two
//! longer (the DSA indexer selects 4 keys) — the logits agree within 1e-4 × that position's
//! max|logit| and the top-1 token is the same; 16 greedy tokens are identical everywhere.
//! llama.cpp builds the q_a/kv_a RMSNorms with `rms_norm_eps` where transformers hard-codes 1e-6:
//! on a model with `rms_norm_eps = 1e-5`, glmcheck with `--latent-norm-eps 1e-5` is the one that
//! matches llama.cpp closely, and with the default 1e-6 the one that matches transformers.
//!
//! llama.cpp comes from `scripts/setup-llamacpp` (which `scripts/test` runs): these tests fail,
//! never skip, when it is missing.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use glmcheck::trace::Trace;

/// At most `index_topk` (4) tokens: every key is selected, DSA is dense.
const SHORT: &str = "5,77,300";
/// Longer than `index_topk`: the indexer really selects.
const MEDIUM: &str = "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16";
/// Greedy tokens generated after each sequence.
pub(super) const GENERATE: usize = 16;
/// Logit agreement asked of every pair, relative to the reference position's max|logit|.
pub(super) const TOLERANCE: f64 = 1e-4;

/// 64 token ids below the vocabulary size (512), from a fixed linear congruential sequence.
pub(super) fn long_sequence() -> String {
    let mut x: u64 = 12345;
    (0..64)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % 512).to_string()
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The oracle folder that scripts/setup-llamacpp builds.
pub(super) fn llama_cpp() -> PathBuf {
    let dir = common::root().join(".oracles/llama.cpp");
    assert!(
        dir.join("build/dump_logits").exists() && dir.join("src/convert_hf_to_gguf.py").exists(),
        "the llama.cpp oracle is not built: run scripts/setup-llamacpp (scripts/test does)"
    );
    dir
}

pub(super) fn read_f32(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

pub(super) fn tokens_of(ids: &str) -> Vec<u64> {
    ids.split(',').map(|t| t.parse().unwrap()).collect()
}

/// What the Python oracle made: the F32 GGUF and, per sequence, transformers' logits and tokens.
pub(super) struct Model {
    pub(super) gguf: PathBuf,
    pub(super) vocab: usize,
    pub(super) hf_logits: Vec<Vec<f32>>,
    pub(super) hf_generated: Vec<serde_json::Value>,
}

/// Run the oracle `module` (`llamacpp.model`, `llamacpp.family`) with `args` and one `--tokens`
/// per sequence, and read what it made.
pub(super) fn oracle_model<'a>(
    module: &str,
    mut args: Vec<&'a str>,
    sequences: &[&'a str],
) -> Model {
    for s in sequences {
        args.extend(["--tokens", s]);
    }
    let stdout = common::run_oracle(module, &args);
    let json: serde_json::Value =
        serde_json::from_str(stdout.lines().last().expect("the oracle prints JSON")).unwrap();
    let seqs = json["sequences"].as_array().unwrap();
    assert_eq!(seqs.len(), sequences.len());
    Model {
        gguf: PathBuf::from(json["gguf"].as_str().unwrap()),
        vocab: json["vocab_size"].as_u64().unwrap() as usize,
        hf_logits: seqs
            .iter()
            .map(|s| read_f32(Path::new(s["logits"].as_str().unwrap())))
            .collect(),
        hf_generated: seqs.iter().map(|s| s["generated"].clone()).collect(),
    }
}

fn make_model(dir: &Path, rms_norm_eps: &str, sequences: &[&str]) -> Model {
    let llama = llama_cpp();
    let (out, src, n) = (
        dir.to_str().unwrap(),
        llama.join("src"),
        GENERATE.to_string(),
    );
    let args = vec![
        out,
        "--llama-cpp",
        src.to_str().unwrap(),
        "--rms-norm-eps",
        rms_norm_eps,
        "--generate",
        &n,
    ];
    oracle_model("llamacpp.model", args, sequences)
}

/// llama.cpp's logits of every prompt position and its greedy tokens after the prompt.
pub(super) fn run_llama_cpp(
    gguf: &Path,
    ids: &str,
    mode: &str,
    out: &Path,
) -> (Vec<f32>, serde_json::Value) {
    let bin = llama_cpp().join("build/dump_logits");
    let run = Command::new(&bin)
        .arg(gguf)
        .arg(out)
        .arg(ids)
        .args(["--mode", mode, "--generate", &GENERATE.to_string()])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "dump_logits --mode {mode} failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(json["mode"], mode);
    assert_eq!(json["n_tokens"].as_u64(), Some(tokens_of(ids).len() as u64));
    (read_f32(out), json["generated"].clone())
}

/// glmcheck's logits, its greedy tokens, and the smallest score gap at a DSA top-k boundary
/// (where a near-tie could flip a selection between two implementations; None when nothing is
/// selected).
pub(super) struct Ours {
    pub(super) logits: Vec<f32>,
    pub(super) generated: serde_json::Value,
    min_index_gap: Option<f32>,
}

pub(super) fn run_glmcheck(gguf: &Path, ids: &str, latent_norm_eps: &str, out: &Path) -> Ours {
    let run = Command::new(common::glmcheck_bin())
        .arg("run")
        .arg(gguf)
        .args(["--tokens", ids, "--generate", &GENERATE.to_string()])
        .args(["--latent-norm-eps", latent_norm_eps])
        .args([
            "--full",
            "logits",
            "--full",
            "*.attn.index_gap",
            "--json",
            "--out",
        ])
        .arg(out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "glmcheck run failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let trace = Trace::open(out).unwrap();
    let mut min_index_gap: Option<f32> = None;
    for stage in trace.stages() {
        if stage.name.ends_with(".attn.index_gap") {
            let gaps = trace.tensor(&stage.name, None).unwrap().unwrap();
            // Positions without a selection record -1.
            for g in gaps.into_iter().filter(|g| *g >= 0.0) {
                min_index_gap = Some(min_index_gap.map_or(g, |m| m.min(g)));
            }
        }
    }
    Ours {
        logits: trace.tensor("logits", None).unwrap().unwrap(),
        generated: json["generated"].clone(),
        min_index_gap,
    }
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b })
}

/// Max |x − reference| over all positions, after asserting at every position that it is within
/// TOLERANCE × that position's max|reference| and that the top-1 tokens agree.
pub(super) fn agree(what: &str, x: &[f32], reference: &[f32], vocab: usize) -> f64 {
    assert_eq!(x.len(), reference.len(), "{what}: sizes");
    let mut worst = 0f64;
    for (pos, (a, b)) in x.chunks(vocab).zip(reference.chunks(vocab)).enumerate() {
        let scale = b.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
        let err = a
            .iter()
            .zip(b)
            .fold(0f64, |m, (p, q)| m.max(f64::from((p - q).abs())));
        assert!(
            err <= TOLERANCE * scale,
            "{what}: position {pos}: max |Δlogit| {err:e} > {TOLERANCE:e} × max|logit| {scale}"
        );
        assert_eq!(argmax(a), argmax(b), "{what}: top-1 at position {pos}");
        worst = worst.max(err);
    }
    worst
}

#[test]
fn converter_gguf_agrees_with_llama_cpp_and_transformers() {
    let dir = common::scratch();
    let long = long_sequence();
    let sequences = [SHORT, MEDIUM, long.as_str()];
    let model = make_model(dir.path(), "1e-6", &sequences);
    for (k, ids) in sequences.iter().enumerate() {
        let n = tokens_of(ids).len();
        let ours = run_glmcheck(
            &model.gguf,
            ids,
            "1e-6",
            &dir.path().join(format!("{k}.trace")),
        );
        let (batch, batch_gen) = run_llama_cpp(
            &model.gguf,
            ids,
            "batch",
            &dir.path().join(format!("{k}-batch.f32")),
        );
        let (incr, incr_gen) = run_llama_cpp(
            &model.gguf,
            ids,
            "incr",
            &dir.path().join(format!("{k}-incr.f32")),
        );
        assert_eq!(
            ours.min_index_gap.is_some(),
            n > 4,
            "{n} tokens: the indexer selects exactly when there are more than index_topk keys"
        );
        let gap = format!("smallest DSA top-k boundary gap {:?}", ours.min_index_gap);
        let vs_batch = agree(
            &format!("{n} tokens, glmcheck vs llama.cpp batch ({gap})"),
            &ours.logits,
            &batch,
            model.vocab,
        );
        let vs_incr = agree(
            &format!("{n} tokens, glmcheck vs llama.cpp one token at a time ({gap})"),
            &ours.logits,
            &incr,
            model.vocab,
        );
        let vs_hf = agree(
            &format!("{n} tokens, glmcheck vs transformers ({gap})"),
            &ours.logits,
            &model.hf_logits[k],
            model.vocab,
        );
        let llama_vs_hf = agree(
            &format!("{n} tokens, llama.cpp batch vs transformers ({gap})"),
            &batch,
            &model.hf_logits[k],
            model.vocab,
        );
        println!(
            "{n} tokens: max |Δlogit| glmcheck−llama.cpp batch {vs_batch:.2e}, incr {vs_incr:.2e}, \
             glmcheck−transformers {vs_hf:.2e}, llama.cpp−transformers {llama_vs_hf:.2e}; {gap}"
        );
        assert_eq!(ours.generated.as_array().unwrap().len(), GENERATE);
        assert_eq!(
            ours.generated, batch_gen,
            "{n} tokens: greedy tokens, llama.cpp batch"
        );
        assert_eq!(
            ours.generated, incr_gen,
            "{n} tokens: greedy tokens, llama.cpp incr"
        );
        assert_eq!(
            ours.generated, model.hf_generated[k],
            "{n} tokens: greedy tokens, transformers"
        );
    }
}

/// GLM-5's own `rms_norm_eps` (1e-5): llama.cpp normalises q_a and kv_a with it, transformers with
/// 1e-6, and `--latent-norm-eps` picks which one glmcheck follows.
#[test]
fn latent_norm_eps_follows_llama_cpp_or_transformers() {
    let dir = common::scratch();
    let long = long_sequence();
    let sequences = [SHORT, long.as_str()];
    let model = make_model(dir.path(), "1e-5", &sequences);
    for (k, ids) in sequences.iter().enumerate() {
        let n = tokens_of(ids).len();
        let as_llama = run_glmcheck(
            &model.gguf,
            ids,
            "1e-5",
            &dir.path().join(format!("{k}-5.trace")),
        );
        let as_hf = run_glmcheck(
            &model.gguf,
            ids,
            "1e-6",
            &dir.path().join(format!("{k}-6.trace")),
        );
        let (batch, batch_gen) = run_llama_cpp(
            &model.gguf,
            ids,
            "batch",
            &dir.path().join(format!("{k}-batch.f32")),
        );
        let (incr, incr_gen) = run_llama_cpp(
            &model.gguf,
            ids,
            "incr",
            &dir.path().join(format!("{k}-incr.f32")),
        );
        let gap = format!(
            "smallest DSA top-k boundary gap {:?}",
            as_llama.min_index_gap
        );
        let matched = agree(
            &format!("{n} tokens, glmcheck --latent-norm-eps 1e-5 vs llama.cpp batch ({gap})"),
            &as_llama.logits,
            &batch,
            model.vocab,
        );
        let matched_incr = agree(
            &format!("{n} tokens, glmcheck --latent-norm-eps 1e-5 vs llama.cpp incr ({gap})"),
            &as_llama.logits,
            &incr,
            model.vocab,
        );
        let hf = agree(
            &format!("{n} tokens, glmcheck --latent-norm-eps 1e-6 vs transformers ({gap})"),
            &as_hf.logits,
            &model.hf_logits[k],
            model.vocab,
        );
        // The other pairing: off by the eps difference, which must show.
        let crossed = agree(
            &format!("{n} tokens, glmcheck --latent-norm-eps 1e-6 vs llama.cpp batch ({gap})"),
            &as_hf.logits,
            &batch,
            model.vocab,
        );
        println!(
            "rms_norm_eps 1e-5, {n} tokens: max |Δlogit| glmcheck(1e-5)−llama.cpp batch \
             {matched:.2e}, incr {matched_incr:.2e}; glmcheck(1e-6)−transformers {hf:.2e}; \
             glmcheck(1e-6)−llama.cpp {crossed:.2e}; {gap}"
        );
        assert!(
            4.0 * matched < crossed,
            "{n} tokens: --latent-norm-eps 1e-5 should follow llama.cpp far more closely than 1e-6 \
             ({matched:e} against {crossed:e})"
        );
        assert_eq!(
            as_llama.generated, batch_gen,
            "{n} tokens: greedy tokens, llama.cpp batch"
        );
        assert_eq!(
            as_llama.generated, incr_gen,
            "{n} tokens: greedy tokens, llama.cpp incr"
        );
        assert_eq!(
            as_hf.generated, model.hf_generated[k],
            "{n} tokens: greedy tokens, transformers"
        );
    }
}
