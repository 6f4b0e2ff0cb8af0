//! SGLang's own debug dumps as candidates: folders written by the unmodified `dumper.py` of the
//! pinned SGLang wheel (`scripts/setup-sglang-dumper`) around a torch GLM-5 named and called as
//! SGLang's DeepseekV2 tensor-parallel prefill (`glmcheck_oracle.sglang`, gloo ranks on CPU).
//! Clean dumps pass at TP 1, 2 and 4; the faults planted in that model are located and classed;
//! several forward passes, a truncated file and a pickle naming a foreign class end in exit 2.

use crate::common;

use std::path::Path;

const TOKENS: &str = "5,17,99,3";

/// Python: replace the pickle of the dump file `argv[1]` by one whose value is `os.system`.
const HOSTILE_PICKLE: &str = r#"
import os, pickle, sys, zipfile
src = sys.argv[1]
with zipfile.ZipFile(src) as z:
    items = {n: z.read(n) for n in z.namelist()}
pkl = [n for n in items if n.endswith('/data.pkl')][0]
items[pkl] = pickle.dumps({'value': os.system, 'meta': {'name': 'x'}}, protocol=2)
with zipfile.ZipFile(src, 'w', zipfile.ZIP_STORED) as out:
    for n, b in items.items():
        out.writestr(n, b)
"#;

/// `glmcheck_oracle.sglang.dump`: the dump folder of one prefill of `TOKENS` at `tp` ranks.
fn dump(hf: &Path, out: &Path, tp: &str, extra: &[&str]) {
    dump_tokens(hf, TOKENS, out, tp, extra)
}

pub fn dump_tokens(hf: &Path, tokens: &str, out: &Path, tp: &str, extra: &[&str]) {
    let mut args = vec![hf.to_str().unwrap(), tokens, out.to_str().unwrap(), tp];
    args.extend(extra);
    common::run_oracle("sglang.dump", &args);
}

pub fn tiny_hf(dir: &Path) -> std::path::PathBuf {
    let hf = dir.join("hf");
    common::synth_tiny(&hf, &["--format", "hf"]);
    hf
}

#[test]
fn clean_dumps_pass_at_every_tensor_parallel_degree() {
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    for (tp, dtype) in [("1", "bf16"), ("2", "bf16"), ("4", "bf16"), ("2", "f32")] {
        let out = dir.path().join(format!("tp{tp}-{dtype}"));
        dump(&hf, &out, tp, &["--dtype", dtype]);
        let j = common::bisect_candidate(&hf, &out, &[], 0);
        let at = format!("TP {tp} {dtype}");
        assert_eq!(j["verdict"], "pass", "{at}: {:#}", j["fault"]);
        assert_eq!(j["bisect"]["backend"], "sglang", "{at}");
        assert_eq!(j["bisect"]["tp"], tp.parse::<u64>().unwrap(), "{at}");
        assert_eq!(j["bisect"]["dtype"], dtype, "{at}");
        let stages: Vec<&str> = j["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["stage"].as_str().unwrap())
            .collect();
        // SGLang's hooks show every stage of the MHA prefill but the DSA top-k (its indexer
        // returns nothing on a prompt shorter than index_topk): the logits of the last token.
        for s in [
            "embed",
            "L0.attn.kv",
            "L1.attn.ctx",
            "L1.moe.topk_ids",
            "L2.out",
            "logits",
        ] {
            assert!(stages.contains(&s), "{at}: {s} compared");
        }
        assert!(!stages.contains(&"L0.attn.index_topk"), "{at}");
        let logits = j["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["stage"] == "logits")
            .unwrap();
        assert!(
            logits["cosine"].as_f64().unwrap() > 0.999,
            "{at}: {logits:#}"
        );
    }
}

/// Each `(fault, stage, class)` planted in the SGLang-named model at `tp` ranks and dumped with
/// `extra`: bisect locates it at `stage` and names `class`.
pub fn faults_located(tokens: &str, tp: &str, extra: &[&str], table: &[(&str, &str, &str)]) {
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    for (fault, stage, class) in table {
        let out = dir.path().join(fault);
        let args = [extra, &["--fault", fault]].concat();
        dump_tokens(&hf, tokens, &out, tp, &args);
        let j = common::bisect_candidate(&hf, &out, &[], 1);
        assert_eq!(
            j["first_divergence"]["stage"], *stage,
            "{fault}: {:#}",
            j["fault"]
        );
        assert_eq!(j["fault"]["class"], *class, "{fault}: {:#}", j["fault"]);
    }
}

/// The faults both dump mechanisms show at the same stage: (fault, stage, class).
pub const FAULTS_EITHER_SHOWS: [(&str, &str, &str); 5] = [
    (
        "skip-o-proj-all-reduce",
        "L1.attn_resid",
        "missing_all_reduce",
    ),
    ("unsharded-kv-b", "L0.attn.kv", "unsharded_weight"),
    ("rank-order-q-b", "L0.attn.q", "wrong_shard_layout"),
    ("rope-neox", "L0.attn.q_rope", "rope_mismatch"),
    ("router-softmax", "L1.moe.topk_weights", "router_mismatch"),
];

#[test]
fn faults_planted_in_the_sglang_model_are_located_and_classed() {
    let scale = ("routed-scale-twice", "L1.ffn.out", "scale_mismatch");
    faults_located(
        TOKENS,
        "2",
        &[],
        &[&FAULTS_EITHER_SHOWS[..], &[scale]].concat(),
    );
    faults_located(TOKENS, "4", &[], &FAULTS_EITHER_SHOWS);
}

/// `bisect MODEL --candidate DUMP`'s one-line error (exit 2).
fn refused(hf: &Path, dump: &Path) -> String {
    let out = common::glmcheck_output(&[
        "bisect",
        hf.to_str().unwrap(),
        "--candidate",
        dump.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

#[test]
fn dumps_glmcheck_cannot_read_as_one_forward_are_refused_naming_the_file() {
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    let steps = dir.path().join("steps");
    // A prefill and two decode steps (the tiny model's index_topk 4 bounds the tokens).
    dump_tokens(&hf, "5,17", &steps, "1", &["--steps", "3"]);
    let err = refused(&hf, &steps);
    assert!(err.contains("3 forward passes"), "{err}");

    let one = dir.path().join("one");
    dump(&hf, &one, "2", &[]);
    let folder = one.join("glmcheck");
    let file_of = |part: &str| {
        std::fs::read_dir(&folder)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().contains(part))
            .unwrap_or_else(|| panic!("a file of {part}"))
    };
    // A file cut short: named, exit 2.
    let q = file_of("q_b_proj.output");
    let bytes = std::fs::read(&q).unwrap();
    std::fs::write(&q, &bytes[..bytes.len() / 2]).unwrap();
    let err = refused(&hf, &one);
    assert!(
        err.contains(&*q.file_name().unwrap().to_string_lossy()),
        "{err}"
    );

    // A pickle that names a class to call: refused by name, never run.
    let hostile = file_of("kv_b_proj.output");
    let script = HOSTILE_PICKLE;
    let status = std::process::Command::new(common::python())
        .arg("-c")
        .arg(script)
        .arg(&hostile)
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::write(&q, &bytes).unwrap();
    let err = refused(&hf, &one);
    assert!(err.contains("names class `posix.system`"), "{err}");
    assert!(
        err.contains(&*hostile.file_name().unwrap().to_string_lossy()),
        "{err}"
    );
}

#[test]
fn a_dump_filtered_to_the_files_glmcheck_reads_passes() {
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    let (whole, kept) = (dir.path().join("whole"), dir.path().join("kept"));
    dump(&hf, &whole, "2", &[]);
    let filter = glmcheck::trace::sglang::names::dumper_filter();
    let out = common::oracle_command(&common::python(), "sglang.dump")
        .env("DUMPER_FILTER", &filter)
        .args([hf.to_str().unwrap(), TOKENS, kept.to_str().unwrap(), "2"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let count = |d: &Path| std::fs::read_dir(d.join("glmcheck")).unwrap().count();
    let (all, few) = (count(&whole), count(&kept));
    assert!(few * 3 < all, "{few} of {all} files kept");
    let j = common::bisect_candidate(&hf, &kept, &[], 0);
    assert_eq!(j["verdict"], "pass", "{:#}", j["fault"]);
    let (a, b) = (
        common::bisect_candidate(&hf, &whole, &[], 0),
        j["stages"].as_array().unwrap().len(),
    );
    assert_eq!(
        a["stages"].as_array().unwrap().len(),
        b,
        "the same stages compared"
    );

    // Every file of the real dump, its bytes changed at random: an error or a value, no panic.
    let mut z: u64 = 1;
    for file in std::fs::read_dir(kept.join("glmcheck")).unwrap().take(8) {
        let path = file.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let bad = dir.path().join("mutated.pt");
        for _ in 0..300 {
            let mut b = bytes.clone();
            for _ in 0..4 {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let at = (z >> 33) as usize % b.len();
                b[at] = (z >> 13) as u8;
            }
            std::fs::write(&bad, &b).unwrap();
            let _ = glmcheck::trace::sglang::pt::read(&bad);
        }
    }
}

#[test]
fn gate_holds_sglang_dumps_to_a_baseline_made_from_one() {
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    let (clean, again, fault) = (
        dir.path().join("clean"),
        dir.path().join("again"),
        dir.path().join("fault"),
    );
    dump(&hf, &clean, "2", &[]);
    dump(&hf, &again, "2", &[]);
    dump(&hf, &fault, "2", &["--fault", "rope-neox"]);
    let baseline = dir.path().join("sglang.baseline.json");
    let gate = |candidate: &Path, extra: &[&str]| {
        let mut args = vec![
            "gate",
            "--baseline",
            baseline.to_str().unwrap(),
            candidate.to_str().unwrap(),
        ];
        args.extend(extra);
        common::glmcheck_output(&args)
    };
    let made = gate(&clean, &["--update", "--model", hf.to_str().unwrap()]);
    assert_eq!(
        made.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    // The baseline names the checkpoint: later dumps need no --model.
    assert_eq!(gate(&again, &[]).status.code(), Some(0));
    let broke = gate(&fault, &["--json"]);
    assert_eq!(broke.status.code(), Some(1));
    let j: serde_json::Value = serde_json::from_slice(&broke.stdout).unwrap();
    let first = j["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["status"] == "fail")
        .unwrap();
    assert_eq!(first["stage"], "L0.attn.q_rope", "{first:#}");

    // A rank's file missing: the stage and the file of the other rank named, exit 2.
    let q = std::fs::read_dir(again.join("glmcheck"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            let n = p.to_string_lossy();
            n.contains("rank=1___") && n.contains("layers.1.self_attn.kv_b_proj.output")
        })
        .unwrap();
    std::fs::remove_file(&q).unwrap();
    let err = refused(&hf, &again);
    assert!(err.contains("no file of rank 1 for L1.attn.kv"), "{err}");
}

#[test]
fn the_sglang_named_model_computes_what_transformers_does() {
    // The fixture must be GLM-5 before its dumps can test glmcheck: every position's logits
    // against transformers' GlmMoeDsaForCausalLM, at each TP, in f32.
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    let out = common::run_oracle(
        "sglang.dump",
        &[hf.to_str().unwrap(), TOKENS, "--check", "--tp", "1,2,4"],
    );
    let rows: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line per TP"))
        .collect();
    assert_eq!(rows.len(), 3, "{out}");
    for r in &rows {
        assert!(r["relative"].as_f64().unwrap() < 1e-5, "{r}");
        assert_eq!(r["same_argmax"], true, "{r}");
    }
}

#[test]
fn shared_experts_fused_into_the_routed_ones_are_read_as_sglang_runs_glm5() {
    // SGLang's default for GLM-5 and DeepSeek-V3 on GPUs: no shared-experts module, a top-k
    // column more (ids past the routed experts), and the experts' output holding both.
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    let clean = dir.path().join("fused");
    dump(&hf, &clean, "2", &["--fuse-shared-experts"]);
    let j = common::bisect_candidate(&hf, &clean, &[], 0);
    assert_eq!(j["verdict"], "pass", "{:#}", j["fault"]);
    let missing = j["bisect"]["not_recorded"].to_string();
    assert!(
        missing.contains("L1.moe.routed") && missing.contains("L1.moe.shared"),
        "{missing}"
    );
    let notes = j["bisect"]["candidate_notes"].to_string();
    assert!(notes.contains("fused the shared experts"), "{notes}");
    faults_located(
        TOKENS,
        "2",
        &["--fuse-shared-experts"],
        &[
            ("router-softmax", "L1.moe.topk_weights", "router_mismatch"),
            ("routed-scale-twice", "L1.ffn.out", "scale_mismatch"),
        ],
    );
}
