//! The llama.cpp probe (`probes/llamacpp`, built by `scripts/setup-llamacpp-probe`) on GGUFs
//! llama.cpp's own converter made from a transformers GLM-5
//! (`glmcheck_oracle.llamacpp.probe_models`), bisected against that transformers folder: F32 and BF16 pass; each planted metadata fault,
//! and random values in one weight, fail at the stage they first change with their class.
//!
//! The trace must be llama.cpp's own numbers: its logits equal `dump_logits`' bit for bit, and
//! every statistic equals glmcheck's `TensorStats::of` of the stored values.
//!
//! Both llama.cpp programs come from `scripts/test`: these tests fail, never skip, without them.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use glmcheck::trace::{ElemType, TensorStats, Trace};

/// Longer than `index_topk` (4): the indexer selects.
const TOKENS: &str = "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16";

fn oracle_bin(rel: &str) -> PathBuf {
    let bin = common::root().join(".oracles").join(rel);
    assert!(
        bin.exists(),
        "{} is not built: run scripts/setup-llamacpp and scripts/setup-llamacpp-probe (scripts/test does)",
        bin.display()
    );
    bin
}

fn probe_bin() -> PathBuf {
    oracle_bin("llamacpp-probe/build/glmcheck-llamacpp-probe")
}

/// The GGUFs of `llamacpp.probe_models`: the oracle's JSON line.
fn models(dir: &Path) -> serde_json::Value {
    let oracle = common::root().join(".oracles/llama.cpp");
    let out = common::run_oracle(
        "llamacpp.probe_models",
        &[
            dir.to_str().unwrap(),
            "--llama-cpp",
            oracle.to_str().unwrap(),
        ],
    );
    serde_json::from_str(out.lines().last().expect("one JSON line")).unwrap()
}

/// The probe's trace of `gguf` on TOKENS, every stage in full.
fn probe(gguf: &str, out: &Path) -> Trace {
    probe_with(gguf, out, TOKENS, &["--full", "**"])
}

/// The probe's trace of `gguf` on `tokens`, with `extra` options.
pub(super) fn probe_with(gguf: &str, out: &Path, tokens: &str, extra: &[&str]) -> Trace {
    let run = Command::new(probe_bin())
        .arg(gguf)
        .args(["--tokens", tokens, "--threads", "2"])
        .args(extra)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "probe on {gguf}: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    Trace::open(out).unwrap()
}

/// llama.cpp's logits of TOKENS through `dump_logits` (the oracle's own program, no callback).
fn dump_logits(gguf: &str, out: &Path) -> Vec<f32> {
    let run = Command::new(oracle_bin("llama.cpp/build/dump_logits"))
        .args([gguf, out.to_str().unwrap(), TOKENS, "--threads", "2"])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    std::fs::read(out)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The stage kinds (names without `L{n}.`) recorded for layer `l`.
fn kinds(t: &Trace, l: u64) -> BTreeSet<String> {
    let prefix = format!("L{l}.");
    t.stages()
        .iter()
        .filter_map(|s| s.name.strip_prefix(&prefix).map(str::to_string))
        .collect()
}

#[test]
fn clean_conversions_pass_and_the_trace_is_llama_cpps() {
    let dir = common::scratch();
    let m = models(dir.path());
    let hf = PathBuf::from(m["hf"].as_str().unwrap());
    for (name, dtype) in [("f32", "f32"), ("bf16", "bf16")] {
        let gguf = m[name].as_str().unwrap();
        let path = dir.path().join(format!("{name}.trace"));
        let trace = probe(gguf, &path);
        assert_eq!(trace.manifest().backend, "llama.cpp");
        assert_eq!(trace.manifest().dtype, dtype, "general.file_type");
        assert!(trace.manifest().model.fingerprint.starts_with("fnv1a64:"));

        let logits = trace.tensor("logits", None).unwrap().unwrap();
        let oracle = dump_logits(gguf, &dir.path().join(format!("{name}.f32")));
        assert!(
            logits == oracle,
            "{name}: the probe's logits are not dump_logits'"
        );
        for s in trace.stages().iter().filter(|s| s.dtype == ElemType::F32) {
            let values = trace.tensor(&s.name, None).unwrap().unwrap();
            assert_eq!(
                TensorStats::of(&values),
                s.stats,
                "{name}: stats of {}",
                s.name
            );
        }
        for s in trace.stages().iter().filter(|s| s.dtype == ElemType::I32) {
            let ids = trace.tensor_i32(&s.name, None).unwrap().unwrap();
            assert_eq!(
                TensorStats::of(&ids),
                s.stats,
                "{name}: stats of {}",
                s.name
            );
        }
        // Layer 0 is dense, 1 and 2 MoE.
        let (dense, moe) = (kinds(&trace, 0), kinds(&trace, 1));
        assert!(dense.len() >= 12 && moe.len() >= 12, "{dense:?} {moe:?}");
        assert_eq!(moe, kinds(&trace, 2));
        println!(
            "{name}: {} stage kinds on the dense layer, {} on a MoE layer: {moe:?}",
            dense.len(),
            moe.len()
        );

        let j = common::bisect_candidate(&hf, &path, &[], 0);
        assert_eq!(j["verdict"], "pass", "{name}: {:#}", j["fault"]);
        assert_eq!(j["bisect"]["dtype"], dtype);
        println!(
            "{name}: bisect pass, tolerance_to_pass {}, envelope {}",
            j["tolerance_to_pass"], j["bisect"]["envelope"]
        );
    }
}

/// bf16 weights make llama.cpp break a near tie of the DSA top-k the other way on this prompt;
/// with the ids in the trace by default, bisect re-runs the reference and envelope taking
/// llama.cpp's choice there, and the file passes.
#[test]
fn a_near_tie_llama_cpp_breaks_otherwise_is_followed_not_failed() {
    let dir = common::scratch();
    let m = models(dir.path());
    let hf = PathBuf::from(m["hf"].as_str().unwrap());
    let path = dir.path().join("bf16-12.trace");
    // The probe's default `--full`, which keeps the top-k ids.
    probe_with(
        m["bf16"].as_str().unwrap(),
        &path,
        "39,100,7,200,5,6,7,8,9,10,11,12",
        &[],
    );
    let j = common::bisect_candidate(&hf, &path, &[], 0);
    assert_eq!(j["verdict"], "pass", "{:#}", j["fault"]);
    assert!(
        j["bisect"]["ties_followed"].as_u64().unwrap() >= 1,
        "{:#}",
        j["bisect"]
    );
}

/// llama.cpp's own quantizations of the F32 file: the envelope is the reference with every
/// weight stored as the GGUF the trace names.
#[test]
fn quantized_ggufs_pass_against_their_stored_types() {
    let dir = common::scratch();
    let m = models(dir.path());
    let hf = PathBuf::from(m["hf"].as_str().unwrap());
    for name in ["q8_0", "q4_k_m"] {
        let path = dir.path().join(format!("{name}.trace"));
        let trace = probe(m[name].as_str().unwrap(), &path);
        let logits = trace.tensor("logits", None).unwrap().unwrap();
        let oracle = dump_logits(m[name].as_str().unwrap(), &dir.path().join("l.f32"));
        assert!(
            logits == oracle,
            "{name}: the probe's logits are not dump_logits'"
        );
        let j = common::bisect_candidate(&hf, &path, &[], 0);
        assert_eq!(j["verdict"], "pass", "{name}: {:#}", j["fault"]);
        assert_eq!(j["bisect"]["conversion"], true, "{name}");
        println!(
            "{name}: bisect pass, tolerance_to_pass {}",
            j["tolerance_to_pass"]
        );
    }
}

#[test]
fn planted_faults_are_located_and_classified() {
    let dir = common::scratch();
    let m = models(dir.path());
    let hf = PathBuf::from(m["hf"].as_str().unwrap());
    let cases = [
        (
            "rope-scaling",
            "L0.attn.q_rope",
            "rope_mismatch",
            "gguf metadata",
        ),
        (
            "rms-eps",
            "L0.attn_norm",
            "norm_eps_mismatch",
            "gguf metadata",
        ),
        (
            "expert-weights-scale",
            "L1.moe.topk_weights",
            "scale_mismatch",
            "gguf metadata",
        ),
        (
            "expert-weights-norm",
            "L1.moe.topk_weights",
            "router_mismatch",
            "gguf metadata",
        ),
        (
            "gating-func",
            "L1.moe.topk_ids",
            "router_mismatch",
            "gguf metadata",
        ),
        ("weight-garbage", "L0.attn.q", "corrupt_weight", "weights"),
    ];
    for (fault, stage, class, by) in cases {
        let gguf = m["faults"][fault]["gguf"].as_str().unwrap();
        let path = dir.path().join(format!("{fault}.trace"));
        probe(gguf, &path);
        let j = common::bisect_candidate(&hf, &path, &[], 1);
        assert_eq!(
            j["first_divergence"]["stage"], stage,
            "{fault}: {:#}",
            j["fault"]
        );
        assert_eq!(j["fault"]["class"], class, "{fault}: {:#}", j["fault"]);
        assert_eq!(j["bisect"]["classified_by"], by, "{fault}");
        if by == "weights" {
            let found = &j["bisect"]["weights"]["findings"][0]["tensor"];
            assert_eq!(
                found, "blk.0.attn_q_b.weight",
                "{fault}: {:#}",
                j["bisect"]["weights"]
            );
        }
        println!("{fault}: {stage}, {class}: {}", j["fault"]["summary"]);
    }
}

/// Faults planted in the bytes of llama.cpp's own files (converter and quantizer) that only a
/// stage llama.cpp never records reads (`attn.kv` from `attn_k_b`/`attn_v_b`), or that stages
/// kept as statistics let through, and metadata keys llama.cpp reads: each traced with the
/// probe's default recording, bisected with the weight check on the path behind the first
/// divergence only (`--weights divergent`), and named by weight and relation, or key and values.
#[test]
fn faults_behind_hidden_stages_are_named() {
    let dir = common::scratch();
    let m = models(dir.path());
    let hf = PathBuf::from(m["hf"].as_str().unwrap());
    // (fault, first divergence, class, tensor and relation or key, the other tensor of a swap)
    let cases = [
        (
            "k-b-heads",
            "L1.attn.ctx",
            "weight_layout",
            "blk.1.attn_k_b.weight head_permutation",
            "",
        ),
        (
            "v-b-heads",
            "L2.attn.ctx",
            "weight_layout",
            "blk.2.attn_v_b.weight head_permutation",
            "",
        ),
        (
            "k-b-v-b-swapped",
            "L1.attn.ctx",
            "weight_layout",
            "blk.1.attn_k_b.weight other_weight",
            "blk.1.attn_v_b.weight",
        ),
        (
            "exps-gate-up",
            "L2.moe.routed",
            "weight_layout",
            "blk.2.ffn_gate_exps.weight other_weight",
            "blk.2.ffn_up_exps.weight",
        ),
        // Inside the Q4_K_M envelope by every moment: the stage's sketch sees it.
        (
            "shexp-gate-up",
            "L1.moe.shared",
            "weight_layout",
            "blk.1.ffn_gate_shexp.weight other_weight",
            "blk.1.ffn_up_shexp.weight",
        ),
        (
            "router-bias-zero",
            "L1.moe.topk_ids",
            "router_mismatch",
            "blk.1.exp_probs_b.bias zeros",
            "",
        ),
        (
            "indexer-proj-negated",
            "L0.attn.index_topk",
            "indexer_mismatch",
            "blk.0.indexer.proj.weight scalar_multiple",
            "",
        ),
        (
            "indexer-top-k",
            "L0.attn.index_topk",
            "indexer_mismatch",
            "glm-dsa.attention.indexer.top_k",
            "",
        ),
        (
            "expert-used-count",
            "L1.moe.topk_ids",
            "router_mismatch",
            "glm-dsa.expert_used_count",
            "",
        ),
        (
            "expert-groups",
            "L1.moe.topk_ids",
            "router_mismatch",
            "glm-dsa.expert_group_count",
            "",
        ),
        // A per-layer array key: layer 2 reuses layer 1's top-k.
        (
            "indexer-types",
            "L2.attn.index_topk",
            "indexer_mismatch",
            "glm-dsa.attention.indexer.types",
            "",
        ),
    ];
    for (fault, stage, class, named, with) in cases {
        let gguf = m["faults"][fault]["gguf"].as_str().unwrap();
        let path = dir.path().join(format!("{fault}.trace"));
        probe_with(gguf, &path, TOKENS, &[]);
        let j = common::bisect_candidate(&hf, &path, &["--weights", "divergent"], 1);
        let f = &j["fault"];
        assert_eq!(j["first_divergence"]["stage"], stage, "{fault}: {f:#}");
        assert_eq!(f["class"], class, "{fault}: {f:#}");
        let b = &j["bisect"];
        let found = if named.starts_with("glm-dsa.") {
            assert_eq!(b["classified_by"], "gguf metadata", "{fault}");
            assert!(
                f["summary"].as_str().unwrap().contains(named),
                "{fault}: {f:#}"
            );
            named.to_string()
        } else {
            assert_eq!(b["classified_by"], "weights", "{fault}: {b:#}");
            let first = &b["weights"]["findings"][0];
            assert_eq!(f["weight"], first["tensor"], "{fault}");
            format!(
                "{} {}",
                first["tensor"].as_str().unwrap(),
                first["relation"].as_str().unwrap()
            )
        };
        assert_eq!(found, named, "{fault}: {:#}", b["weights"]);
        if !with.is_empty() {
            assert_eq!(b["weights"]["findings"][0]["with"], with, "{fault}");
            assert!(
                f["summary"].as_str().unwrap().contains("swapped"),
                "{fault}: {f:#}"
            );
        }
        println!(
            "{fault}: {stage}, {class}: {} (path {})",
            f["summary"], b["path"]
        );
    }
    // llama.cpp never forms attn.kv: the swapped heads behind L1.attn.ctx are found there.
    let j = common::bisect_candidate(
        &hf,
        &dir.path().join("k-b-heads.trace"),
        &["--weights", "divergent"],
        1,
    );
    let hidden = &j["bisect"]["path"]["hidden"];
    assert!(
        hidden.as_array().unwrap().iter().any(|s| s == "L1.attn.kv"),
        "{:#}",
        j["bisect"]["path"]
    );
}

/// A swap of the shared expert's gate and up in a file `llama-quantize` made (Q4_K_M), with the
/// default weight check (every tensor of a file under 32 GiB): both tensors named, each with the
/// one it was swapped with.
#[test]
fn a_sibling_swap_is_named_by_the_whole_file_check() {
    let dir = common::scratch();
    let m = models(dir.path());
    let hf = PathBuf::from(m["hf"].as_str().unwrap());
    let path = dir.path().join("shexp.trace");
    probe_with(
        m["faults"]["shexp-gate-up"]["gguf"].as_str().unwrap(),
        &path,
        TOKENS,
        &[],
    );
    let j = common::bisect_candidate(&hf, &path, &[], 1);
    assert_eq!(
        j["first_divergence"]["stage"], "L1.moe.shared",
        "{:#}",
        j["fault"]
    );
    assert_eq!(j["fault"]["class"], "weight_layout");
    let w = &j["bisect"]["weights"];
    assert_eq!(w["checked"], "all");
    let names: Vec<(&str, &str)> = w["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["tensor"].as_str().unwrap(),
                f["with"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            ("blk.1.ffn_gate_shexp.weight", "blk.1.ffn_up_shexp.weight"),
            ("blk.1.ffn_up_shexp.weight", "blk.1.ffn_gate_shexp.weight")
        ]
    );
}

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    let dir = common::scratch();
    let not_gguf = dir.path().join("config.json");
    std::fs::write(&not_gguf, "{}").unwrap();
    let cases: [Vec<&str>; 3] = [
        vec![
            not_gguf.to_str().unwrap(),
            "--tokens",
            "1",
            "--out",
            "x.trace",
        ],
        vec![not_gguf.to_str().unwrap(), "--out", "x.trace"],
        vec![
            not_gguf.to_str().unwrap(),
            "--tokens",
            "1,a",
            "--out",
            "x.trace",
        ],
    ];
    for args in cases {
        let run = Command::new(probe_bin())
            .args(&args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.starts_with("glmcheck-llamacpp-probe: ") && err.lines().count() == 1,
            "{args:?}: {err}"
        );
    }
}
