//! SGLang's own debug dumps as candidates: folders written by the unmodified `dumper.py` of the
//! pinned SGLang wheel (`scripts/setup-sglang-dumper`) around a torch model of the family named
//! and called as SGLang's DeepseekV2 tensor-parallel prefill (`glmcheck_oracle.sglang`, gloo
//! ranks on CPU): GLM-5, and DeepSeek-V2, V2-Lite, V3, V3.2, Kimi-K2 and GLM-4.7-Flash as
//! SGLang serves each. Clean dumps pass at TP 1, 2 and 4; the faults planted in that model are
//! located and classed; several forward passes, a truncated file and a pickle naming a foreign
//! class end in exit 2.

use crate::common;

use serde_json::Value;

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

/// `glmcheck synth --family FAMILY --format hf` of the tiny preset, in `dir/FAMILY`.
pub fn family_hf(dir: &Path, family: &str) -> std::path::PathBuf {
    let hf = dir.join(family);
    common::synth_tiny(&hf, &["--format", "hf", "--family", family]);
    hf
}

pub fn tiny_hf(dir: &Path) -> std::path::PathBuf {
    family_hf(dir, "glm5")
}

/// `bisect` of the clean dump `out` of `hf` at `tp` in `dtype`: a pass read as SGLang's, which
/// compared each of `compared` and the last token's logits nearly exactly.
fn assert_clean(hf: &Path, out: &Path, tp: &str, dtype: &str, compared: &[&str]) -> Value {
    let j = common::bisect_candidate(hf, out, &[], 0);
    let at = format!("{}, TP {tp} {dtype}", hf.display());
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
    for s in compared.iter().chain(&["logits"]) {
        assert!(stages.contains(s), "{at}: {s} compared");
    }
    let logits = stage(&j, "logits");
    assert!(
        logits["cosine"].as_f64().unwrap() > 0.999,
        "{at}: {logits:#}"
    );
    j
}

/// Stage `name` of a bisect's JSON.
fn stage<'a>(j: &'a Value, name: &str) -> &'a Value {
    j["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == name)
        .unwrap_or_else(|| panic!("{name} compared: {j:#}"))
}

#[test]
fn clean_dumps_pass_at_every_tensor_parallel_degree() {
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    for (tp, dtype) in [("1", "bf16"), ("2", "bf16"), ("4", "bf16"), ("2", "f32")] {
        let out = dir.path().join(format!("tp{tp}-{dtype}"));
        dump(&hf, &out, tp, &["--dtype", dtype]);
        // SGLang's hooks show every stage of the MHA prefill but the DSA top-k (its indexer
        // returns nothing on a prompt shorter than index_topk): the logits of the last token.
        let compared = [
            "embed",
            "L0.attn.kv",
            "L1.attn.ctx",
            "L1.moe.topk_ids",
            "L2.out",
        ];
        let j = assert_clean(&hf, &out, tp, dtype, &compared);
        let stages = j["stages"].as_array().unwrap();
        assert!(stages.iter().all(|s| s["stage"] != "L0.attn.index_topk"));
    }
}

/// One dump: TP, dtype and the dump command's extra options.
type Run = (&'static str, &'static str, &'static [&'static str]);

/// What each member of the family beside GLM-5 is dumped as: its runs and the stages glmcheck
/// reads nowhere in the dump.
const FAMILY_RUNS: [(&str, &[Run], &[&str]); 6] = [
    (
        "deepseek-v3",
        &[
            ("1", "bf16", &[]),
            ("2", "bf16", &[]),
            ("4", "bf16", &[]),
            ("2", "f32", &[]),
            // SGLang's default for DeepSeek-V3 on GPUs (dv2:3322, :3357-3373).
            ("2", "bf16", &["--fuse-shared-experts"]),
        ],
        &[],
    ),
    ("deepseek-v2", &[("2", "bf16", &[])], &[]),
    // No q LoRA: SGLang's q_proj makes the query, read as `attn.q`.
    ("deepseek-v2-lite", &[("2", "bf16", &[])], &[]),
    ("kimi-k2", &[("2", "bf16", &[])], &[]),
    ("glm-4.7-flash", &[("2", "bf16", &[])], &[]),
    // V3 with GLM-5's DSA indexer: on a prompt within index_topk it returns nothing, as GLM-5's.
    (
        "deepseek-v3.2",
        &[("2", "bf16", &[])],
        &[
            "L0.attn.index_topk",
            "L1.attn.index_topk",
            "L2.attn.index_topk",
        ],
    ),
];

#[test]
fn clean_dumps_of_the_rest_of_the_family_pass_as_sglang_serves_each() {
    let dir = common::scratch();
    for (family, runs, unread) in FAMILY_RUNS {
        let hf = family_hf(dir.path(), family);
        for (tp, dtype, extra) in runs {
            let out = dir
                .path()
                .join(format!("{family}-tp{tp}-{dtype}{}", extra.concat()));
            dump(&hf, &out, tp, &[&["--dtype", dtype], *extra].concat());
            // The MLA attention with its YaRN, the grouped router's choices and weights.
            let compared = [
                "L0.attn.q_rope",
                "L0.attn.k_rope",
                "L0.attn.kv",
                "L0.attn.ctx",
                "L1.moe.router_logits",
                "L1.moe.topk_ids",
                "L1.moe.topk_weights",
                "L2.ffn.out",
            ];
            let j = assert_clean(&hf, &out, tp, dtype, &compared);
            let at = format!("{family}, TP {tp} {dtype} {extra:?}");
            let missing = &j["bisect"]["not_recorded"];
            if extra.is_empty() {
                let want: Vec<Value> = unread.iter().map(|s| Value::from(*s)).collect();
                let got = missing.as_array().cloned().unwrap_or_default();
                assert_eq!(got, want, "{at}");
            } else {
                // Fused: the routed and shared experts' outputs are one (as for GLM-5 below).
                assert!(missing.to_string().contains("L1.moe.shared"), "{at}");
            }
            // The reference routed every position as SGLang did.
            assert_eq!(stage(&j, "L1.moe.topk_ids")["rel_diff"], 0.0, "{at}");
        }
    }
}

/// Each `(fault, stage, class)` planted in the SGLang-named model of `family` at `tp` ranks and
/// dumped with `extra`: bisect locates it at `stage` and names `class`. The bisects' JSON, in
/// the table's order.
pub fn faults_located(
    family: &str,
    (tokens, tp): (&str, &str),
    extra: &[&str],
    table: &[(&str, &str, &str)],
) -> Vec<Value> {
    let dir = common::scratch();
    let hf = family_hf(dir.path(), family);
    let mut found = Vec::new();
    for (fault, stage, class) in table {
        let out = dir.path().join(fault);
        let args = [extra, &["--fault", fault]].concat();
        dump_tokens(&hf, tokens, &out, tp, &args);
        let j = common::bisect_candidate(&hf, &out, &[], 1);
        assert_eq!(
            j["first_divergence"]["stage"], *stage,
            "{family} {fault}: {:#}",
            j["fault"]
        );
        assert_eq!(
            j["fault"]["class"], *class,
            "{family} {fault}: {:#}",
            j["fault"]
        );
        found.push(j);
    }
    found
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
        "glm5",
        (TOKENS, "2"),
        &[],
        &[&FAULTS_EITHER_SHOWS[..], &[scale]].concat(),
    );
    faults_located("glm5", (TOKENS, "4"), &[], &FAULTS_EITHER_SHOWS);
}

#[test]
fn faults_of_the_family_s_own_features_are_located_and_classed_on_deepseek_v3() {
    // DeepSeek-V3's router limits each token to the best 2 of 4 expert groups and its MLA
    // attention multiplies the softmax scale by YaRN's mscale² (factor 40, mscale_all_dim 1:
    // (0.1·ln 40 + 1)² = 1.8739). In f32, where glmcheck counts the router's choices.
    let summary = |j: &Value| j["fault"]["summary"].as_str().unwrap().to_owned();
    let found = faults_located(
        "deepseek-v3",
        (TOKENS, "2"),
        &["--dtype", "f32"],
        &[
            ("group-limit-ignored", "L1.moe.topk_ids", "router_mismatch"),
            ("yarn-mscale-dropped", "L0.attn.ctx", "scale_mismatch"),
            ("router-softmax", "L1.moe.topk_weights", "router_mismatch"),
        ],
    );
    let grouped = summary(&found[0]);
    assert!(
        grouped.contains(
            "every expert group competing: the group limit (the best 2 of 4 groups) left out"
        ),
        "{grouped}"
    );
    assert_eq!(stage(&found[0], "L1.moe.topk_ids")["rel_diff"], 0.25);
    let yarn = summary(&found[1]);
    assert!(
        yarn.contains("× 0.5337: YaRN's mscale² (1.8739, from mscale_all_dim) left out"),
        "{yarn}"
    );
    // The same fit from a bf16 dump, SGLang's usual dtype.
    let bf16 = summary(
        &faults_located(
            "deepseek-v3",
            (TOKENS, "2"),
            &[],
            &[("yarn-mscale-dropped", "L0.attn.ctx", "scale_mismatch")],
        )[0],
    );
    assert!(
        bf16.contains("× 0.5337: YaRN's mscale² (1.8739, from mscale_all_dim) left out"),
        "{bf16}"
    );
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
    // The fixture must be each member before its dumps can test glmcheck: every position's
    // logits against transformers' class of the checkpoint, at the TPs its dumps use, in f32.
    let dir = common::scratch();
    for (family, tps) in [
        ("glm5", "1,2,4"),
        ("deepseek-v3", "1,2,4"),
        ("deepseek-v2", "2"),
        ("deepseek-v2-lite", "2"),
        ("kimi-k2", "2"),
        ("glm-4.7-flash", "2"),
        ("deepseek-v3.2", "2"),
    ] {
        let hf = family_hf(dir.path(), family);
        let out = common::run_oracle(
            "sglang.dump",
            &[hf.to_str().unwrap(), TOKENS, "--check", "--tp", tps],
        );
        let rows: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line per TP"))
            .collect();
        assert_eq!(rows.len(), tps.split(',').count(), "{family}: {out}");
        for r in &rows {
            assert!(r["relative"].as_f64().unwrap() < 1e-5, "{family}: {r}");
            assert_eq!(r["same_argmax"], true, "{family}: {r}");
        }
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
        "glm5",
        (TOKENS, "2"),
        &["--fuse-shared-experts"],
        &[
            ("router-softmax", "L1.moe.topk_weights", "router_mismatch"),
            ("routed-scale-twice", "L1.ffn.out", "scale_mismatch"),
        ],
    );
}
