//! vLLM 0.32 run as its users run it, for the `vllm_today*` tests: the interpreter, the tiny
//! models, `python -m glmcheck_probe.vllm_capture` runs (vLLM's CPU build through its public
//! `LLM` class, one worker process per rank, in a process group killed afterwards) and the
//! checks of what they wrote (`glmcheck bisect` and `glmcheck shards` with the shard manifest).
//!
//! The models have GLM-5's MLA widths (kv_lora_rank 512, qk_rope_head_dim 64): vLLM's MLA
//! metadata accepts no other head size. The interpreter is `$GLMCHECK_VLLM32_PYTHON`, else
//! `.venv-vllm32/bin/python` (`scripts/setup-vllm 0.32`); missing, the tests fail.

use crate::common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

pub(crate) const TOKENS: &str = "1,5,9,33,70,100,200,300";

/// The interpreter with vLLM 0.32 and glmcheck's plugins.
pub(crate) fn vllm_python() -> PathBuf {
    common::vllm_python("GLMCHECK_VLLM32_PYTHON", ".venv-vllm32", "0.32")
}

/// The tiny preset as a Hugging Face folder with GLM-5's MLA widths.
pub(crate) fn model(dir: &Path) -> PathBuf {
    family_model(dir, "glm5")
}

/// `model` for a member of the family (`glmcheck synth --family`), in the folder `family`.
pub(crate) fn family_model(dir: &Path, family: &str) -> PathBuf {
    let hf = dir.join(family);
    common::synth_tiny(
        &hf,
        &[
            "--format",
            "hf",
            "--family",
            family,
            "--set",
            "kv_lora_rank=512",
            "--set",
            "qk_rope_head_dim=64",
        ],
    );
    hf
}

/// vLLM's two GLM-5 model trees: the CPU tree it builds on a CPU, and the CUDA tree a GPU
/// runs, built here with glmcheck's stand-ins for its kernels (`vllm_capture --tree`).
pub(crate) const TREES: [&str; 2] = ["cpu", "cuda"];

/// `vllm_capture` of `model` with vLLM's `tree` at `tp` in `dtype`, with the tests' `fault`
/// planted in vLLM; the capture folder and the capture's summary line.
pub(crate) fn capture(
    model: &Path,
    tree: &str,
    tp: u64,
    dtype: &str,
    fault: Option<&str>,
) -> (PathBuf, Value) {
    capture_served(&Served::hf(model), tree, tp, dtype, fault)
}

/// What vLLM is given to serve: a Hugging Face folder, or a GGUF beside the folder with its
/// config and tokenizer, and the environment of the run.
pub(crate) struct Served<'a> {
    pub(crate) model: &'a Path,
    pub(crate) hf: Option<&'a Path>,
    pub(crate) env: &'a [(&'a str, &'a str)],
    /// Names the run's capture folder among others of the same model.
    pub(crate) label: &'a str,
}

impl<'a> Served<'a> {
    pub(crate) fn hf(model: &'a Path) -> Self {
        Served {
            model,
            hf: None,
            env: &[],
            label: "",
        }
    }
}

pub(crate) fn capture_served(
    served: &Served,
    tree: &str,
    tp: u64,
    dtype: &str,
    fault: Option<&str>,
) -> (PathBuf, Value) {
    let out = served.model.with_file_name(format!(
        "{tree}-tp{tp}-{dtype}-{}{}",
        fault.unwrap_or("clean"),
        served.label
    ));
    let mut cmd = Command::new(vllm_python());
    cmd.args(["-m", "glmcheck_probe.vllm_capture"])
        .arg(served.model)
        .args([
            "--tree",
            tree,
            "--tp",
            &tp.to_string(),
            "--tokens",
            TOKENS,
            "--dtype",
            dtype,
        ])
        .arg("--out")
        .arg(&out)
        .env_remove(GGUF_RANK_FIX)
        .envs(served.env.iter().copied());
    if let Some(hf) = served.hf {
        cmd.arg("--hf-config-path")
            .arg(hf)
            .arg("--tokenizer")
            .arg(hf);
    }
    match fault {
        Some(f) => cmd.env("GLMCHECK_VLLM_FAULT", f),
        None => cmd.env_remove("GLMCHECK_VLLM_FAULT"),
    };
    let run = output_in_own_group(&mut cmd, CAPTURE_LIMIT);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "vllm_capture of the {tree} tree at TP {tp}, {dtype}, {fault:?} failed:\n{stderr}"
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    let summary = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .unwrap_or_else(|| panic!("no summary line in vllm_capture's output:\n{stdout}"));
    (out, summary)
}

/// Far beyond a capture's minute or so on 2 cores, even beside another test's.
const CAPTURE_LIMIT: Duration = Duration::from_secs(900);

/// `cmd`'s output, run in a process group of its own that is killed afterwards: the worker
/// processes of a vLLM run that failed can outlive it, spinning, and slow every later test. A
/// run past `limit` is killed too, and fails its test rather than hanging the suite.
pub(crate) fn output_in_own_group(cmd: &mut Command, limit: Duration) -> Output {
    let child = cmd
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the vLLM 0.32 interpreter");
    let group = format!("-{}", child.id());
    let kill = {
        let group = group.clone();
        move || Command::new("kill").args(["-KILL", "--", &group]).status()
    };
    let finished = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (finished, kill) = (finished.clone(), kill.clone());
        std::thread::spawn(move || {
            let started = Instant::now();
            while !finished.load(Ordering::Relaxed) {
                if started.elapsed() > limit {
                    let _ = kill();
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let out = child.wait_with_output().expect("wait for vllm_capture");
    finished.store(true, Ordering::Relaxed);
    let _ = kill();
    let _ = watchdog.join();
    out
}

/// `glmcheck bisect MODEL --candidate run.trace --actual shards.json --json` on a capture.
pub(crate) fn bisect(model: &Path, out: &Path) -> Value {
    let shards = out.join("shards.json");
    let code = |v: &Value| if v["verdict"] == "pass" { 0 } else { 1 };
    let report = common::glmcheck_output(&[
        "bisect",
        model.to_str().unwrap(),
        "--candidate",
        out.join("run.trace").to_str().unwrap(),
        "--actual",
        shards.to_str().unwrap(),
        "--json",
    ]);
    let v: Value = serde_json::from_slice(&report.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&report.stderr)));
    assert_eq!(report.status.code(), Some(code(&v)), "{v:#}");
    v
}

/// A clean capture's checks: no notes, `bisect` passes, and the trace is vLLM 0.32's at `tp`,
/// recording each of `stages`; `what` names the run in failures.
pub(crate) fn assert_clean(
    model: &Path,
    (out, summary): (&Path, &Value),
    tp: u64,
    what: &str,
    stages: &[&str],
) {
    assert_eq!(summary["tp"], tp);
    assert_eq!(summary["notes"], Value::Array(vec![]), "{summary:#}");
    let v = bisect(model, out);
    assert_eq!(v["verdict"], "pass", "{what}: {v:#}");
    let trace = json(&out.join("run.trace/manifest.json"));
    assert_eq!(trace["producer"]["vllm"], "0.32.0");
    assert_eq!(trace["tp"], tp);
    let recorded: Vec<&str> = trace["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    for stage in stages {
        assert!(
            recorded.contains(stage),
            "{what}: {stage} not recorded: {recorded:?}"
        );
    }
}

pub(crate) fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A merged shard manifest lists each of `names` (rank 0's weights).
pub(crate) fn assert_lists(shards: &Value, names: &[&str]) {
    let listed: Vec<&str> = shards["ranks"][0]["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["name"].as_str().unwrap())
        .collect();
    for name in names {
        assert!(
            listed.contains(name),
            "{name} not in the manifest: {listed:?}"
        );
    }
}

pub(crate) fn evidence(v: &Value) -> String {
    v["fault"]["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// `glmcheck shards MODEL --actual SHARDS --json`, whose exit code says the verdict (0 pass,
/// 1 any mismatch).
pub(crate) fn shards_check(model: &Path, out: &Path) -> Value {
    let run = common::glmcheck_output(&[
        "shards",
        model.to_str().unwrap(),
        "--actual",
        out.join("shards.json").to_str().unwrap(),
        "--json",
    ]);
    let v: Value = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&run.stderr)));
    let code = if v["verdict"] == "pass" { 0 } else { 1 };
    assert_eq!(run.status.code(), Some(code), "{v:#}");
    v
}

/// The tests' plugin turns on vllm-gguf-plugin's fix of its merged-column and QKV loaders
/// (`glmcheck_oracle.vllm32.glm_dsa_gguf`), which 0.0.5 lacks.
pub(crate) const GGUF_RANK_FIX: &str = "GLMCHECK_VLLM_GGUF_RANK_FIX";
