//! `glmcheck verify` and `glmcheck bisect --candidate` against files made by llama.cpp's own
//! tools, with faults planted in their stored bytes.
//!
//! `glmcheck_oracle.llamacpp.quants` makes a tiny GLM-5 wide enough for K-quants (every matrix
//! llama.cpp quantizes has rows of 256 or 512), saved by transformers, converted to F32 by
//! llama.cpp's converter and quantized by `llama-quantize` to Q8_0, Q6_K, Q4_K_M and IQ4_XS, and
//! to Q4_K_M with an importance matrix from `llama-imatrix`; `llama-gguf-split` cuts the Q4_K_M
//! into a split set of three files (opened as one model; a fault goes into a later file).
//! `glmcheck_oracle.formats.plant_gguf_fault` copies one of those files and rewrites bytes of
//! one tensor in place (swapped experts or heads, doubled block scales, zeroed or random blocks,
//! a NaN scale, rows of another tensor, an untransposed attn_k_b), checking the effect with
//! gguf-py's dequantization.
//!
//! Every honest file passes both commands against the Hugging Face folder and against the F32
//! GGUF: no finding, and every tensor of a plain quantization is exactly the bytes of glmcheck's
//! re-quantization (the imatrix file: exact or within its type's noise). Every planted fault
//! fails both: verify names the planted tensor with the fault's class and relation and no other
//! tensor; bisect gives the class and the planted tensor's GGUF name. The results print as a
//! Markdown table (`--nocapture`).
//!
//! llama.cpp comes from `scripts/setup-llamacpp`: this test fails, never skips, without it.
//!
//! The files and faults checked are listed in `verify_llamacpp_cases`.

use crate::common;
use crate::verify_llamacpp_cases::{Fault, FAULTS, HONEST};

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use serde_json::{json, Value};

/// 16 token ids below the vocabulary size (512).
const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12,300,301,17,450";

/// What `llamacpp.quants` made: every file by its key, and the GGML type of every tensor of
/// every GGUF.
struct Artifacts {
    dir: PathBuf,
    files: BTreeMap<String, PathBuf>,
    types: Value,
}

impl Artifacts {
    fn file(&self, key: &str) -> &Path {
        self.files
            .get(key)
            .unwrap_or_else(|| panic!("llamacpp.quants made no {key}"))
    }

    fn ty(&self, file: &str, tensor: &str) -> &str {
        self.types[file][tensor]
            .as_str()
            .unwrap_or_else(|| panic!("{file} has no tensor {tensor}"))
    }
}

/// The llama.cpp oracle folder, which must hold the converter and llama.cpp's quantize and
/// imatrix tools.
fn llama_cpp() -> PathBuf {
    let dir = common::root().join(".oracles/llama.cpp");
    let built = |tool: &str| dir.join("build/tools").join(tool).is_file();
    assert!(
        dir.join("src/convert_hf_to_gguf.py").exists()
            && built("quantize/llama-quantize")
            && built("imatrix/llama-imatrix"),
        "the llama.cpp oracle is not built: run scripts/setup-llamacpp (scripts/test does)"
    );
    dir
}

/// The files, made once per test process in a fresh folder of the target directory.
fn artifacts() -> &'static Artifacts {
    static ARTIFACTS: OnceLock<Artifacts> = OnceLock::new();
    ARTIFACTS.get_or_init(|| {
        let oracle = llama_cpp();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("verify-llamacpp");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).unwrap();
        }
        std::fs::create_dir_all(&dir).unwrap();
        let stdout = common::run_oracle(
            "llamacpp.quants",
            &[
                dir.to_str().unwrap(),
                "--llama-cpp",
                oracle.to_str().unwrap(),
            ],
        );
        let json: Value =
            serde_json::from_str(stdout.lines().last().expect("llamacpp.quants prints JSON"))
                .unwrap();
        let files = json["files"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), PathBuf::from(v.as_str().unwrap())))
            .collect();
        Artifacts {
            dir,
            files,
            types: json["types"].clone(),
        }
    })
}

/// `glmcheck ARGS…`: its exit code and its stdout as JSON (Null when it printed none).
pub(crate) fn glmcheck(args: &[&str]) -> (i32, Value, String) {
    let out = common::glmcheck_output(args);
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (
        out.status.code().unwrap_or(-1),
        json,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub(crate) fn verify(reference: &Path, candidate: &Path) -> (i32, Value, String) {
    glmcheck(&[
        "verify",
        reference.to_str().unwrap(),
        candidate.to_str().unwrap(),
        "--json",
    ])
}

pub(crate) fn bisect(reference: &Path, candidate: &Path) -> (i32, Value, String) {
    glmcheck(&[
        "bisect",
        reference.to_str().unwrap(),
        "--candidate",
        candidate.to_str().unwrap(),
        "--json",
        "--tokens",
        TOKENS,
        "--generate",
        "0",
    ])
}

/// One case: an honest file (its key) or a planted fault, against a reference (its key).
enum Case {
    Honest(&'static str),
    Planted(&'static Fault),
}

/// One line of the table, with what went wrong (empty: the case passed).
pub(crate) struct Row {
    pub file: String,
    pub reference: &'static str,
    pub fault: String,
    pub tensor: String,
    pub verify: String,
    pub bisect: String,
    pub problems: Vec<String>,
}

pub(crate) fn verify_cell(code: i32, j: &Value) -> String {
    let findings: Vec<String> = j["findings"]
        .as_array()
        .map(|f| {
            f.iter()
                .map(|f| {
                    format!(
                        "{}/{}",
                        f["class"].as_str().unwrap_or("?"),
                        f["relation"].as_str().unwrap_or("?")
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let failed = &j["summary"]["failed"];
    if findings.is_empty() {
        format!("exit {code}, {} failed", failed)
    } else {
        format!("exit {code}: {}", findings.join(", "))
    }
}

pub(crate) fn bisect_cell(code: i32, j: &Value) -> String {
    let class = j["fault"]["class"].as_str().unwrap_or("—");
    let stage = j["first_divergence"]["stage"].as_str().unwrap_or("—");
    format!("exit {code}: {class} / {stage}")
}

/// The exit code a command must give, its stderr shown otherwise.
pub(crate) fn exit(problems: &mut Vec<String>, what: &str, code: i32, want: i32, stderr: &str) {
    if code != want {
        let tail: String = stderr.lines().rev().take(6).collect::<Vec<_>>().join(" | ");
        problems.push(format!("{what} exited {code}, not {want} ({tail})"));
    }
}

/// An honest file: both commands pass with nothing found; verify reproduces llama.cpp's bytes.
fn honest(a: &Artifacts, key: &str, reference: &'static str) -> Row {
    let (reference_path, candidate) = (a.file(reference), a.file(key));
    let mut problems = Vec::new();

    let (vcode, v, stderr) = verify(reference_path, candidate);
    exit(&mut problems, "verify", vcode, 0, &stderr);
    if v["verdict"] != "pass" {
        problems.push(format!("verify verdict {}", v["verdict"]));
    }
    if v["summary"]["failed"] != 0 {
        problems.push(format!("verify: {} tensors failed", v["summary"]["failed"]));
    }
    if v["findings"].as_array().is_none_or(|f| !f.is_empty()) {
        problems.push(format!("verify findings: {}", v["findings"]));
    }
    let imatrix = key.ends_with("-imatrix");
    if v["candidate_imatrix"] != imatrix {
        problems.push(format!("candidate_imatrix is {}", v["candidate_imatrix"]));
    }
    let tensors = v["tensors"].as_array().cloned().unwrap_or_default();
    let listed = a.types[key].as_object().map_or(0, |t| t.len());
    if tensors.len() != listed {
        problems.push(format!(
            "verify listed {} tensors, the file has {listed}",
            tensors.len()
        ));
    }
    for t in &tensors {
        let status = t["status"].as_str().unwrap_or("?");
        let ok = if imatrix {
            status == "exact" || status == "noise"
        } else {
            status == "exact"
        };
        if !ok {
            problems.push(format!(
                "{} ({}) is {status} (rel_diff {}, noise {})",
                t["tensor"], t["type"], t["rel_diff"], t["noise"]
            ));
        }
    }

    let (bcode, b, stderr) = bisect(reference_path, candidate);
    exit(&mut problems, "bisect", bcode, 0, &stderr);
    if b["verdict"] != "pass" {
        problems.push(format!("bisect verdict {}", b["verdict"]));
    }
    if !b["fault"]["weight"].is_null() {
        problems.push(format!("bisect blames {}", b["fault"]["weight"]));
    }
    // bisect's own weight check of a conversion: nothing found there either (a file against
    // itself is no conversion and has none).
    let weights = &b["bisect"]["weights"];
    let conversion = reference_path != candidate;
    let clean =
        weights["checked"] == "all" && weights["failed"] == 0 && weights["findings"] == json!([]);
    if (conversion && !clean) || (!conversion && !weights.is_null()) {
        problems.push(format!("bisect weight check: {weights}"));
    }

    let n = |s: &str| tensors.iter().filter(|t| t["status"] == s).count();
    Row {
        file: format!("{key}.gguf"),
        reference,
        fault: "none".into(),
        tensor: format!(
            "all {} ({} exact, {} noise)",
            tensors.len(),
            n("exact"),
            n("noise")
        ),
        verify: verify_cell(vcode, &v),
        bisect: bisect_cell(bcode, &b),
        problems,
    }
}

/// A planted fault: both commands fail, naming the planted tensor and only it.
fn planted(a: &Artifacts, f: &Fault, reference: &'static str) -> Row {
    let (reference_path, honest) = (a.file(reference), a.file(f.file));
    // A split set's copy keeps the set's numbering (the planter copies every file).
    let honest_name = honest.file_name().unwrap().to_str().unwrap();
    let set = honest_name
        .find("-00001-of-")
        .map_or(".gguf", |i| &honest_name[i..]);
    let name = format!(
        "{}-{}-{}-{}{set}",
        f.file,
        f.fault,
        f.tensor.trim_end_matches(".weight"),
        reference.replace('.', "_")
    );
    let candidate = a.dir.join(name);
    let (verify, bisect, problems) = plant_and_judge(honest, &candidate, reference_path, f);
    Row {
        file: format!("{}.gguf", f.file),
        reference,
        fault: format!("{} {}", f.fault, f.args.join(" "))
            .trim()
            .to_string(),
        tensor: format!("`{}` ({})", f.tensor, a.ty(f.file, f.tensor)),
        verify,
        bisect,
        problems,
    }
}

/// `f` planted into a copy of `honest` at `candidate`, then verify and bisect against
/// `reference`: their table cells, and every way they miss the planted tensor and only it.
pub(crate) fn plant_and_judge(
    honest: &Path,
    candidate: &Path,
    reference: &Path,
    f: &Fault,
) -> (String, String, Vec<String>) {
    let mut args = vec![
        honest.to_str().unwrap(),
        candidate.to_str().unwrap(),
        f.fault,
        f.tensor,
    ];
    args.extend(f.args);
    let stdout = common::run_oracle("formats.plant_gguf_fault", &args);
    let plant: Value = serde_json::from_str(stdout.trim()).unwrap();
    let mut problems = Vec::new();
    if plant["check"]["confirmed"] != true {
        problems.push(format!(
            "the fault is not what it should be: {}",
            plant["check"]
        ));
    }

    let (vcode, v, stderr) = verify(reference, candidate);
    exit(&mut problems, "verify", vcode, 1, &stderr);
    if v["verdict"] != "fail" {
        problems.push(format!("verify verdict {}", v["verdict"]));
    }
    if v["summary"]["failed"] != 1 {
        problems.push(format!(
            "verify: {} tensors failed, not 1",
            v["summary"]["failed"]
        ));
    }
    let findings = v["findings"].as_array().cloned().unwrap_or_default();
    let others: Vec<&Value> = findings
        .iter()
        .filter(|x| x["tensor"] != f.tensor)
        .map(|x| &x["tensor"])
        .collect();
    if !others.is_empty() {
        problems.push(format!("verify also blames {others:?}"));
    }
    if !findings
        .iter()
        .any(|x| x["tensor"] == f.tensor && x["class"] == f.class && x["relation"] == f.relation)
    {
        problems.push(format!(
            "verify: no {}/{} finding on {}: {}",
            f.class,
            f.relation,
            f.tensor,
            Value::Array(findings.clone())
        ));
    }

    let (bcode, b, stderr) = bisect(reference, candidate);
    exit(&mut problems, "bisect", bcode, 1, &stderr);
    if b["verdict"] != "fail" {
        problems.push(format!("bisect verdict {}", b["verdict"]));
    }
    if b["fault"]["class"] != f.class {
        problems.push(format!(
            "bisect class {}, not {}",
            b["fault"]["class"], f.class
        ));
    }
    if b["fault"]["weight"] != f.tensor {
        problems.push(format!(
            "bisect blames {}, not {}",
            b["fault"]["weight"], f.tensor
        ));
    }

    if problems.is_empty() {
        // Kept only to look into a failure.
        let _ = std::fs::remove_file(candidate);
    }
    (verify_cell(vcode, &v), bisect_cell(bcode, &b), problems)
}

fn markdown(rows: &[Row]) -> String {
    let mut s = String::from(
        "| file | reference | fault | tensor (type) | verify: class/relation | bisect: class / stage | |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let reference = if r.reference == "hf" {
            "hf/"
        } else {
            "f32.gguf"
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.file,
            reference,
            r.fault,
            r.tensor,
            r.verify,
            r.bisect,
            if r.problems.is_empty() {
                "pass"
            } else {
                "FAIL"
            }
        ));
    }
    s
}

#[test]
fn llamacpp_files_honest_and_planted() {
    let a = artifacts();
    let mut cases: Vec<(Case, &'static str)> = Vec::new();
    for reference in ["hf", "f32"] {
        cases.extend(HONEST.iter().map(|k| (Case::Honest(k), reference)));
    }
    cases.extend(FAULTS.iter().map(|f| (Case::Planted(f), "hf")));
    cases.extend(
        FAULTS
            .iter()
            .filter(|f| f.gguf_reference)
            .map(|f| (Case::Planted(f), "f32")),
    );

    // Two at a time (each glmcheck call is single-threaded and short).
    let next = AtomicUsize::new(0);
    let rows: Vec<Mutex<Option<Row>>> = cases.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some((case, reference)) = cases.get(i) else {
                    break;
                };
                let row = catch_unwind(AssertUnwindSafe(|| match case {
                    Case::Honest(key) => honest(a, key, reference),
                    Case::Planted(f) => planted(a, f, reference),
                }))
                .unwrap_or_else(|e| {
                    let msg = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    let (file, fault, tensor) = match case {
                        Case::Honest(k) => (k.to_string(), "none".to_string(), String::new()),
                        Case::Planted(f) => (
                            f.file.to_string(),
                            f.fault.to_string(),
                            format!("`{}`", f.tensor),
                        ),
                    };
                    Row {
                        file: format!("{file}.gguf"),
                        reference,
                        fault,
                        tensor,
                        verify: "—".into(),
                        bisect: "—".into(),
                        problems: vec![format!("panicked: {msg}")],
                    }
                });
                *rows[i].lock().unwrap() = Some(row);
            });
        }
    });
    let rows: Vec<Row> = rows
        .into_iter()
        .map(|r| r.into_inner().unwrap().unwrap())
        .collect();

    println!("{}", markdown(&rows));
    let failures: Vec<String> = rows
        .iter()
        .filter(|r| !r.problems.is_empty())
        .map(|r| {
            format!(
                "{} (reference {}) {} {}: {}",
                r.file,
                r.reference,
                r.fault,
                r.tensor,
                r.problems.join("; ")
            )
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}
