//! vLLM 0.32, run as its users run it: `python -m glmcheck_probe.vllm_capture` starts vLLM's CPU
//! build through its public `LLM` class at tensor parallelism 1, 2 and 4 (one worker process per
//! rank, gloo), on a `glmcheck synth --format hf` checkpoint loaded by vLLM's own safetensors
//! loader into each of vLLM's two GLM-5 model trees: the CPU tree (`deepseek_v2.py`
//! `GlmMoeDsaForCausalLM`) that vLLM builds on a CPU, and the CUDA tree
//! (`vllm/models/deepseek_v32/nvidia/`) that a GPU runs, built on the CPU with `--tree cuda`.
//! glmcheck's vLLM plugin (`probes/glmcheck_probe/vllm_plugin.py`, `vllm_cuda_tree.py`) stands
//! in for the GPU kernels (sparse MLA attention, the DSA indexer, the CUDA tree's fused norms
//! and rotations) and writes each rank's shard manifest as loaded; the probe, installed in every
//! worker through `collective_rpc`, records the forward.
//!
//! Clean runs of both trees pass `glmcheck bisect MODEL --candidate TRACE --actual SHARDS` in f32
//! and bf16 at TP 1, 2 and 4. Bugs planted inside vLLM's own code by the tests' plugin
//! (`glmcheck_oracle.vllm32`, `GLMCHECK_VLLM_FAULT`) are each located at their first divergent
//! stage and classed (the CUDA tree at TP 2 and 4, the CPU tree at TP 4): its loader cutting `kv_b_proj` at rank 0's
//! offset on every rank (the story's fault), its router ignoring the correction bias, an o_proj
//! all-reduce left out, RoPE positions off by one, and the experts' loader swapping gate and up.
//!
//! `glm-dsa` Q4_K_M GGUFs — one made by llama.cpp's converter and `llama-quantize --imatrix`,
//! others by `glmcheck synth` — run through `vllm-gguf-plugin` 0.0.5 with the user's weights
//! adapter for them (`glmcheck_oracle.vllm32.glm_dsa_gguf`): they pass at
//! TP 1; at TP 2 the plugin's own loader bug (rank 0's rows of every merged-column weight on
//! every rank) is found; with the plugin's fix, TP 2 and 4 pass, and the story's `kv_b_proj`
//! fault, the plugin's byte split of Q4_K blocks and a config without GLM-5's indexer RoPE
//! style are each located and classed.
//!
//! The model has GLM-5's MLA widths (kv_lora_rank 512, qk_rope_head_dim 64): vLLM's MLA metadata
//! accepts no other head size. The interpreter is `$GLMCHECK_VLLM32_PYTHON`, else
//! `.venv-vllm32/bin/python` (`scripts/setup-vllm 0.32`); missing, the tests fail.

use crate::common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

const TOKENS: &str = "1,5,9,33,70,100,200,300";

/// The interpreter with vLLM 0.32 and glmcheck's plugins.
fn vllm_python() -> PathBuf {
    common::vllm_python("GLMCHECK_VLLM32_PYTHON", ".venv-vllm32", "0.32")
}

/// The tiny preset as a Hugging Face folder with GLM-5's MLA widths.
fn model(dir: &Path) -> PathBuf {
    let hf = dir.join("hf");
    common::synth_tiny(
        &hf,
        &[
            "--format",
            "hf",
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
const TREES: [&str; 2] = ["cpu", "cuda"];

/// GLM-5-FP8's layout (`synth --quant fp8`: FP8 E4M3 linear weights with 128×128 block scales)
/// with widths vLLM's FP8 block layers accept at TP 4: every rank's share of a split dimension
/// is whole 128-blocks (8 heads of 64 + 64, experts of 512).
fn fp8_model(dir: &Path) -> PathBuf {
    let hf = dir.join("fp8");
    let sets = [
        "kv_lora_rank=512",
        "qk_rope_head_dim=64",
        "qk_nope_head_dim=64",
        "v_head_dim=64",
        "moe_intermediate_size=512",
    ];
    let mut args = vec!["--format", "hf", "--quant", "fp8"];
    args.extend(sets.iter().flat_map(|s| ["--set", s]));
    common::synth_tiny(&hf, &args);
    hf
}

/// `vllm_capture` of `model` with vLLM's `tree` at `tp` in `dtype`, with the tests' `fault`
/// planted in vLLM; the capture folder and the capture's summary line.
fn capture(
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
struct Served<'a> {
    model: &'a Path,
    hf: Option<&'a Path>,
    env: &'a [(&'a str, &'a str)],
    /// Names the run's capture folder among others of the same model.
    label: &'a str,
}

impl<'a> Served<'a> {
    fn hf(model: &'a Path) -> Self {
        Served {
            model,
            hf: None,
            env: &[],
            label: "",
        }
    }
}

fn capture_served(
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
fn output_in_own_group(cmd: &mut Command, limit: Duration) -> Output {
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
fn bisect(model: &Path, out: &Path) -> Value {
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

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A merged shard manifest lists each of `names` (rank 0's weights).
fn assert_lists(shards: &Value, names: &[&str]) {
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

/// Clean captures of both trees at `tp` in f32 and bf16: each passes, from a trace of vLLM
/// 0.32 that holds every stage the probe expects (the router's choices and the DSA top-k
/// among them), with a manifest written as loaded.
fn clean(tp: u64) {
    let dir = common::scratch();
    let hf = model(dir.path());
    for (tree, dtype) in TREES
        .into_iter()
        .flat_map(|t| ["float32", "bfloat16"].map(|d| (t, d)))
    {
        let (out, summary) = capture(&hf, tree, tp, dtype, None);
        assert_eq!(summary["tp"], tp);
        assert_eq!(summary["notes"], Value::Array(vec![]), "{summary:#}");
        let v = bisect(&hf, &out);
        assert_eq!(v["verdict"], "pass", "{tree} tree, TP {tp} {dtype}: {v:#}");
        let trace = json(&out.join("run.trace/manifest.json"));
        assert_eq!(trace["producer"]["vllm"], "0.32.0");
        assert_eq!(trace["tp"], tp);
        let stages: Vec<&str> = trace["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap())
            .collect();
        for stage in [
            "embed",
            "L0.attn.index_topk",
            "L1.moe.topk_ids",
            "L1.moe.topk_weights",
            "L2.moe.shared",
            "logits",
        ] {
            assert!(stages.contains(&stage), "{stage} not recorded: {stages:?}");
        }
        let shards = json(&out.join("shards.json"));
        assert_eq!(shards["tp"], tp);
        assert_eq!(shards["producer"]["when"], "as loaded");
        assert_lists(
            &shards,
            &[
                "model.layers.0.self_attn.kv_b_proj.weight",
                "model.layers.1.mlp.experts.w13_weight",
                "model.layers.1.mlp.shared_experts.gate_up_proj.weight",
                "lm_head.weight",
            ],
        );
    }
}

#[test]
fn clean_captures_pass_at_tp1() {
    clean(1);
}

#[test]
fn clean_captures_pass_at_tp2() {
    clean(2);
}

#[test]
fn clean_captures_pass_at_tp4() {
    clean(4);
}

/// `fault` planted in vLLM, run by the CUDA tree (what GPUs run) at TP 2 and 4 and by the CPU
/// tree at TP 4: the diagnosis of each run.
fn faulty(fault: &str) -> Vec<(&'static str, u64, Value)> {
    let dir = common::scratch();
    let hf = model(dir.path());
    [("cuda", 2), ("cuda", 4), ("cpu", 4)]
        .into_iter()
        .map(|(tree, tp)| {
            let (out, _) = capture(&hf, tree, tp, "float32", Some(fault));
            let v = bisect(&hf, &out);
            assert_eq!(v["verdict"], "fail", "{fault}, {tree} tree, TP {tp}: {v:#}");
            (tree, tp, v)
        })
        .collect()
}

fn evidence(v: &Value) -> String {
    v["fault"]["evidence"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn kv_b_proj_cut_at_rank_0_on_every_rank_is_an_unsharded_weight_naming_ranks_and_rows() {
    for (tree, tp, v) in faulty("unsharded-kv-b") {
        let fault = &v["fault"];
        assert_eq!(
            fault["class"], "unsharded_weight",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert_eq!(
            fault["weight"], "model.layers.0.self_attn.kv_b_proj.weight",
            "{v:#}"
        );
        assert_eq!(v["first_divergence"]["layer"], 0, "{v:#}");
        let summary = fault["summary"].as_str().unwrap();
        assert!(
            summary.contains(&format!("{} of {tp} ranks", tp - 1)),
            "{summary}"
        );
        // 8 heads of 32 + 32 rows: every rank holds rank 0's rows.
        let rows = 512 / tp;
        let text = evidence(&v);
        for rank in 1..tp {
            assert!(
                text.contains(&format!(
                    "on rank {rank} holds rows 0..{rows} of 512, the same block as every rank; \
                     the plan gives rows {}..{}",
                    rank * rows,
                    (rank + 1) * rows
                )),
                "TP {tp} rank {rank}: {text}"
            );
        }
    }
}

#[test]
fn a_router_that_ignores_the_correction_bias_is_a_router_mismatch_at_the_first_moe_layer() {
    for (tree, tp, v) in faulty("router-bias-ignored") {
        assert_eq!(
            v["fault"]["class"], "router_mismatch",
            "{tree} tree, TP {tp}: {v:#}"
        );
        let stage = v["first_divergence"]["stage"].as_str().unwrap();
        assert!(
            stage == "L1.moe.topk_ids" || stage == "L1.moe.topk_weights",
            "{tree} tree, TP {tp}: {stage}"
        );
    }
}

#[test]
fn an_o_proj_all_reduce_left_out_is_a_missing_all_reduce_where_the_ranks_disagree() {
    for (tree, tp, v) in faulty("skip-o-proj-all-reduce") {
        assert_eq!(
            v["fault"]["class"], "missing_all_reduce",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert!(evidence(&v).contains("producer.disagree"), "{v:#}");
        // The CPU tree's o_proj all-reduces its output; the CUDA tree's leaves it as partial
        // sums, all-reduced where the residual is added before the post-attention norm.
        if tree == "cpu" {
            assert_eq!(v["first_divergence"]["stage"], "L1.attn.out", "{v:#}");
        } else {
            assert_eq!(v["first_divergence"]["stage"], "L1.attn_resid", "{v:#}");
            assert!(
                evidence(&v).contains("L1.attn.out is recorded as the ranks' partial sums"),
                "{v:#}"
            );
        }
    }
}

#[test]
fn rope_positions_off_by_one_are_a_rope_mismatch_at_the_first_rotation() {
    for (tree, tp, v) in faulty("rope-positions-shifted") {
        assert_eq!(
            v["fault"]["class"], "rope_mismatch",
            "{tree} tree, TP {tp}: {v:#}"
        );
        let stage = v["first_divergence"]["stage"].as_str().unwrap();
        assert!(
            stage == "L0.attn.q_rope" || stage == "L0.attn.k_rope",
            "{tree} tree, TP {tp}: {stage}"
        );
        assert!(evidence(&v).contains("positions"), "{v:#}");
    }
}

#[test]
fn experts_loaded_with_gate_and_up_swapped_are_a_weight_layout_of_w13_on_every_rank() {
    for (tree, tp, v) in faulty("w13-halves-swapped") {
        let fault = &v["fault"];
        assert_eq!(
            fault["class"], "weight_layout",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert_eq!(fault["weight"], "model.layers.1.mlp.experts.w13_weight");
        assert_eq!(v["first_divergence"]["layer"], 1, "{v:#}");
        let summary = fault["summary"].as_str().unwrap();
        assert!(
            summary.contains(&format!("{tp} of {tp} ranks")),
            "{summary}"
        );
    }
}

/// `glmcheck shards MODEL --actual SHARDS --json`, whose exit code says the verdict (0 pass,
/// 1 any mismatch).
fn shards_check(model: &Path, out: &Path) -> Value {
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

/// An FP8 checkpoint loaded by vLLM's own FP8 block-scaled layers (`Fp8LinearMethod`,
/// `Fp8MoEMethod`; on a CPU without AMX through the plugin's torch W8A16 stand-ins): clean runs
/// of both trees pass, and every rank's FP8 weight and its block scales are the plan's slices.
#[test]
fn an_fp8_checkpoint_passes_with_every_weight_and_block_scale_as_planned() {
    let dir = common::scratch();
    let hf = fp8_model(dir.path());
    for (tree, tp) in [("cpu", 2), ("cuda", 4)] {
        let (out, summary) = capture(&hf, tree, tp, "bfloat16", None);
        assert_eq!(summary["notes"], Value::Array(vec![]), "{summary:#}");
        let v = bisect(&hf, &out);
        assert_eq!(v["verdict"], "pass", "{tree} tree, TP {tp}: {v:#}");
        let checked = shards_check(&hf, &out);
        assert_eq!(checked["verdict"], "pass", "{checked:#}");
        assert_eq!(checked["checked"], checked["ok"], "{checked:#}");
        assert_lists(
            &json(&out.join("shards.json")),
            &[
                "model.layers.0.self_attn.kv_b_proj.weight",
                "model.layers.0.self_attn.kv_b_proj.weight_scale_inv",
                "model.layers.0.self_attn.fused_qkv_a_proj.weight_scale_inv",
                "model.layers.1.mlp.experts.w13_weight_scale_inv",
                "model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv",
            ],
        );
    }
}

/// vLLM's loader cutting `kv_b_proj`'s FP8 block scales at rank 0's offset on every rank while
/// the weight itself is cut right: `unsharded_weight` of `weight_scale_inv`, each rank's scale
/// rows named, the weight they scale matching no slice.
#[test]
fn fp8_block_scales_cut_at_rank_0_are_an_unsharded_weight_scale_inv() {
    let dir = common::scratch();
    let hf = fp8_model(dir.path());
    for (tree, tp) in [("cpu", 2), ("cuda", 4)] {
        let (out, _) = capture(&hf, tree, tp, "bfloat16", Some("kv-b-scales-unsharded"));
        let v = bisect(&hf, &out);
        assert_eq!(v["verdict"], "fail", "{tree} tree, TP {tp}: {v:#}");
        let fault = &v["fault"];
        assert_eq!(
            fault["class"], "unsharded_weight",
            "{tree} tree, TP {tp}: {v:#}"
        );
        assert_eq!(
            fault["weight"], "model.layers.0.self_attn.kv_b_proj.weight_scale_inv",
            "{v:#}"
        );
        assert_eq!(v["first_divergence"]["layer"], 0, "{v:#}");
        // 8 heads of 64 + 64 rows: 1024 rows, 8 scale rows.
        let rows = 8 / tp;
        let text = evidence(&v);
        for rank in 1..tp {
            assert!(
                text.contains(&format!(
                    "weight_scale_inv on rank {rank} holds rows 0..{rows} of 8, the same block \
                     as every rank; the plan gives rows {}..{}",
                    rank * rows,
                    (rank + 1) * rows
                )),
                "{tree} tree, TP {tp}, rank {rank}: {text}"
            );
        }
        assert!(
            text.contains("kv_b_proj.weight on rank 1: its statistics match no slice"),
            "{text}"
        );
    }
}

/// vLLM's fused shared experts (ROCm AITER's layout, turned on for a load on the CPU by the
/// tests' plugin): the shared expert is stored as expert 8 of `w13_weight` / `w2_weight`, cut
/// like a routed expert, and no `shared_experts` weight is left. `vllm_capture --shards-only`
/// writes the load's manifest; `glmcheck shards --actual` plans the fused slot from the shared
/// expert's checkpoint weights and checks it, and finds the slot's gate and up swapped.
#[test]
fn fused_shared_experts_are_planned_and_checked_in_the_stacked_experts() {
    let dir = common::scratch();
    let hf = model(dir.path());
    for tp in [2, 4] {
        for fault in [None, Some("fused-shared-halves-swapped")] {
            let out = dir
                .path()
                .join(format!("fused-tp{tp}-{}", fault.unwrap_or("clean")));
            let mut cmd = Command::new(vllm_python());
            cmd.args(["-m", "glmcheck_probe.vllm_capture"])
                .arg(&hf)
                .args([
                    "--tp",
                    &tp.to_string(),
                    "--shards-only",
                    "--dtype",
                    "float32",
                ])
                .arg("--out")
                .arg(&out)
                .env("GLMCHECK_VLLM_FUSE_SHARED_EXPERTS", "1");
            match fault {
                Some(f) => cmd.env("GLMCHECK_VLLM_FAULT", f),
                None => cmd.env_remove("GLMCHECK_VLLM_FAULT"),
            };
            let run = cmd.output().expect("start vllm_capture");
            assert!(
                run.status.success(),
                "TP {tp} {fault:?}: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            let shards = json(&out.join("shards.json"));
            let weights = shards["ranks"][0]["weights"].as_array().unwrap();
            let w13 = weights
                .iter()
                .find(|w| w["name"] == "model.layers.1.mlp.experts.w13_weight")
                .unwrap();
            assert_eq!(w13["shape"][0], 9, "8 routed experts and the shared one");
            assert!(
                !weights
                    .iter()
                    .any(|w| w["name"].as_str().unwrap().contains("shared_experts")),
                "no separate shared expert when fused"
            );
            let checked = shards_check(&hf, &out);
            assert_eq!(
                checked["not_in_manifest"],
                Value::Array(vec![]),
                "{checked:#}"
            );
            let mismatched: Vec<(&str, &str)> = checked["mismatches"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| (m["weight"].as_str().unwrap(), m["class"].as_str().unwrap()))
                .collect();
            if fault.is_none() {
                assert_eq!(checked["verdict"], "pass", "TP {tp}: {checked:#}");
            } else {
                // Both MoE layers, every rank: w13 only, its fused slot's halves swapped.
                assert_eq!(mismatched.len(), 2 * tp as usize, "{checked:#}");
                for (name, class) in mismatched {
                    assert!(name.ends_with("mlp.experts.w13_weight"), "{checked:#}");
                    assert_eq!(class, "weight_layout", "{checked:#}");
                }
            }
        }
    }
}

/// A `vllm serve` process (vLLM's OpenAI server module: the `vllm` command of the CPU build looks
/// itself up under the distribution name `vllm` and fails), killed with its engine and workers
/// when dropped.
struct Server {
    child: std::process::Child,
    url: String,
}

impl Server {
    /// The server on `model` at `tp` with the probe's worker extension, vLLM's dev mode (which
    /// opens `/collective_rpc`), glmcheck's plugin writing shard manifests to `shards`, and the
    /// tests' `fault` planted; ready when `/health` answers.
    fn start(model: &Path, tp: u64, shards: &Path, fault: &str) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(shards.with_extension("log")).unwrap();
        let child = Command::new(vllm_python())
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--tensor-parallel-size",
                &tp.to_string(),
                "--dtype",
                "float32",
            ])
            .args(["--enforce-eager", "--attention-backend", "CPU_MLA"])
            .args(["-cc", r#"{"custom_ops":["-rotary_embedding"]}"#])
            .args(["--max-model-len", "256", "--max-num-batched-tokens", "256"])
            .args(["--max-num-seqs", "1", "--skip-tokenizer-init"])
            .args([
                "--worker-extension-cls",
                "glmcheck_probe.vllm_worker.ProbeWorker",
            ])
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("GLMCHECK_SHARDS_DIR", shards)
            .env("GLMCHECK_VLLM_FAULT", fault)
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", "0|1")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("start vLLM's server");
        let server = Server {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() || !server.healthy() {
            assert!(
                started.elapsed().as_secs() < 300,
                "vLLM's server not ready in 300 s: {}",
                std::fs::read_to_string(shards.with_extension("log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_secs(2));
        }
        server
    }

    fn healthy(&self) -> bool {
        let probe = format!(
            "import urllib.request; urllib.request.urlopen('{}/health', timeout=5)",
            self.url
        );
        Command::new(vllm_python())
            .args(["-c", &probe])
            .output()
            .is_ok_and(|o| o.status.success())
    }
}

impl Drop for Server {
    /// SIGTERM to the server's process group (vLLM's engine and workers), SIGKILL after 30 s.
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let signal = |s: &str| Command::new("kill").args([s, "--", &group]).status();
        let _ = signal("-TERM");
        for _ in 0..30 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        let _ = signal("-KILL");
        let _ = self.child.wait();
    }
}

#[test]
fn a_running_vllm_server_is_captured_from_outside_and_the_unsharded_kv_b_found() {
    let dir = common::scratch();
    let hf = model(dir.path());
    let shards = dir.path().join("server-shards");
    let server = Server::start(&hf, 2, &shards, "unsharded-kv-b");
    let out = dir.path().join("served");
    let run = Command::new(vllm_python())
        .args(["-m", "glmcheck_probe.vllm_capture", "--server", &server.url])
        .args(["--tokens", TOKENS])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("start vllm_capture");
    drop(server);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let summary: Value = serde_json::from_slice(
        String::from_utf8_lossy(&run.stdout)
            .lines()
            .last()
            .unwrap()
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(summary["tp"], 2);
    assert_eq!(summary["model"], hf.to_str().unwrap());
    let v = bisect(&hf, &out);
    assert_eq!(v["fault"]["class"], "unsharded_weight", "{v:#}");
    assert!(
        evidence(&v).contains("on rank 1 holds rows 0..256 of 512"),
        "{v:#}"
    );
}

/// What a capture cannot be made from: one line naming it, exit code 2, before or instead of
/// starting vLLM.
#[test]
fn a_capture_that_cannot_be_made_is_one_line_and_exit_2() {
    let dir = common::scratch();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = format!("http://127.0.0.1:{port}");
    let taken = dir.path().join("taken");
    std::fs::create_dir_all(taken.join("ranks")).unwrap();
    let cases: [(Vec<&str>, String); 9] = [
        (
            vec!["--server", &server, "--tokens", TOKENS],
            format!("vllm_capture: {server}/v1/models: "),
        ),
        (
            vec!["model", "--tokens", "1,x"],
            "vllm_capture: --tokens '1,x': not comma-separated integers".into(),
        ),
        (
            vec!["--tokens", TOKENS],
            "vllm_capture: give MODEL, or --server URL of a running vLLM".into(),
        ),
        (
            vec!["model", "--server", &server, "--tokens", TOKENS],
            "vllm_capture: --server: model: the model and engine arguments".into(),
        ),
        (
            vec![
                "--server",
                &server,
                "--tokens",
                TOKENS,
                "--out",
                taken.to_str().unwrap(),
            ],
            format!("vllm_capture: {}: already holds files", taken.display()),
        ),
        (
            vec!["--server", &server, "--tree", "cuda", "--tokens", TOKENS],
            "vllm_capture: --server: --tree cuda: the model and engine arguments".into(),
        ),
        (
            vec![
                "model",
                "--tp",
                "2",
                "--tensor-parallel-size",
                "4",
                "--tokens",
                TOKENS,
            ],
            "vllm_capture: --tp 2 and --tensor-parallel-size 4 disagree; give one".into(),
        ),
        (
            vec!["model"],
            "vllm_capture: give the prompt: --tokens IDS or --prompt TEXT (or --shards-only)"
                .into(),
        ),
        (
            vec!["model", "--shards-only", "--tokens", TOKENS],
            "vllm_capture: --shards-only runs no prompt".into(),
        ),
    ];
    for (args, expected) in cases {
        let run = Command::new(vllm_python())
            .args(["-m", "glmcheck_probe.vllm_capture"])
            .args(&args)
            .args(
                (!args.contains(&"--out"))
                    .then_some(["--out", dir.path().join("none").to_str().unwrap()])
                    .into_iter()
                    .flatten(),
            )
            .output()
            .expect("start vllm_capture");
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with(&expected), "{args:?}: {stderr}");
    }
}

/// The tests' plugin turns on vllm-gguf-plugin's fix of its merged-column and QKV loaders
/// (`glmcheck_oracle.vllm32.glm_dsa_gguf`), which 0.0.5 lacks.
const GGUF_RANK_FIX: &str = "GLMCHECK_VLLM_GGUF_RANK_FIX";

/// The tiny preset as a glm-dsa Q4_K_M GGUF in llama.cpp's layout (`kv_b_proj` split into
/// `attn_k_b` / `attn_v_b`), served by vLLM through vllm-gguf-plugin with the user's glm-dsa
/// patch, beside the Hugging Face folder that gives vLLM its config and tokenizer. `aligned`
/// widens o_proj's and the dense MLP's inputs (v_head_dim 128, intermediate 1024) so that
/// TP 4 splits only whole Q4_K blocks.
fn gguf_model(dir: &Path, aligned: bool) -> (PathBuf, PathBuf) {
    let mut sets = vec!["kv_lora_rank=512", "qk_rope_head_dim=64"];
    if aligned {
        sets.extend(["v_head_dim=128", "intermediate_size=1024"]);
    }
    let sets: Vec<&str> = sets.into_iter().flat_map(|s| ["--set", s]).collect();
    let gguf = dir.join("model.gguf");
    let hf = dir.join("hf");
    common::synth_tiny(&gguf, &[&sets[..], &["--quant", "q4_k_m"]].concat());
    common::synth_tiny(&hf, &[&sets[..], &["--format", "hf"]].concat());
    (gguf, hf)
}

/// A GGUF through the plugin: captures of `gguf` (config from `hf`) with `env`.
fn served_gguf<'a>(
    gguf: &'a Path,
    hf: &'a Path,
    env: &'a [(&'a str, &'a str)],
    label: &'a str,
) -> Served<'a> {
    Served {
        model: gguf,
        hf: Some(hf),
        env,
        label,
    }
}

const WITH_RANK_FIX: &[(&str, &str)] = &[(GGUF_RANK_FIX, "1")];

/// At TP 1 the plugin's loaders cut nothing: the GGUF passes on both trees, from a manifest of
/// the plugin's own parameters (the quantized bytes under their checkpoint names, with their
/// GGML types) and a trace of the forward through the plugin's layers.
#[test]
fn a_glm_dsa_gguf_through_vllm_gguf_plugin_passes_on_both_trees_at_tp1() {
    let dir = common::scratch();
    let (gguf, hf) = gguf_model(dir.path(), false);
    for (tree, dtype) in [("cpu", "float32"), ("cuda", "bfloat16")] {
        let (out, summary) =
            capture_served(&served_gguf(&gguf, &hf, &[], ""), tree, 1, dtype, None);
        assert_eq!(summary["notes"], Value::Array(vec![]), "{summary:#}");
        let v = bisect(&gguf, &out);
        assert_eq!(v["verdict"], "pass", "{tree} tree, {dtype}: {v:#}");
        let shards = json(&out.join("shards.json"));
        assert_eq!(shards["version"], 2, "a manifest of GGUF bytes");
        let weights = shards["ranks"][0]["weights"].as_array().unwrap();
        let type_of = |name: &str| {
            weights
                .iter()
                .find(|w| w["name"] == name)
                .unwrap_or_else(|| panic!("{name} not in the manifest"))["ggml_type"]
                .clone()
        };
        // Held as the file's blocks: a merged layer's part, the stacked experts, the table.
        assert_eq!(type_of("model.layers.0.mlp.gate_proj.weight"), "Q4_K");
        assert!(type_of("model.layers.1.mlp.experts.down_proj").is_string());
        assert!(type_of("model.embed_tokens.weight").is_string());
        // Rebuilt from attn_k_b / attn_v_b by the user's patch: floats.
        assert_eq!(
            type_of("model.layers.0.self_attn.kv_b_proj.weight"),
            Value::Null
        );
    }
}

/// A GLM-5 made by transformers, converted by llama.cpp's converter and quantized to Q4_K_M
/// with an importance matrix by `llama-quantize --imatrix` (`glmcheck_oracle.llamacpp.quants`),
/// at widths vLLM's MLA takes (kv_lora_rank 512, rope 64) and whose row splits at TP 2 keep
/// whole blocks; the GGUF and the Hugging Face folder transformers saved.
fn llama_cpp_gguf(dir: &Path) -> (PathBuf, PathBuf) {
    let oracle = common::root().join(".oracles/llama.cpp");
    let sets = [
        "kv_lora_rank=512",
        "qk_rope_head_dim=64",
        "v_head_dim=128",
        "moe_intermediate_size=512",
    ];
    let mut args = vec![
        dir.to_str().unwrap(),
        "--llama-cpp",
        oracle.to_str().unwrap(),
    ];
    args.extend(sets.iter().flat_map(|s| ["--set", s]));
    let printed = common::run_oracle("llamacpp.quants", &args);
    let v: Value = serde_json::from_str(printed.lines().last().unwrap()).unwrap();
    let file = |key: &str| PathBuf::from(v["files"][key].as_str().unwrap());
    (file("q4_k_m-imatrix"), file("hf"))
}

/// A folder with `hf`'s config and tokenizer (not its weights: vLLM reads the GGUF's), the
/// config given the routing and RoPE keys GLM-5's own config.json carries and transformers'
/// `GlmMoeDsaConfig` does not define (a config it writes has none) — without `topk_method` vLLM builds no correction bias and
/// the load fails; without `indexer_rope_interleave` its indexer rotates half-split (NeoX).
/// `indexer_interleave: false` leaves that one key out.
fn glm5_config(hf: &Path, name: &str, indexer_interleave: bool) -> PathBuf {
    let out = hf.with_file_name(name);
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(hf).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e != "safetensors") {
            std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
        }
    }
    let mut cfg = json(&out.join("config.json"));
    cfg["topk_method"] = "noaux_tc".into();
    cfg["scoring_func"] = "sigmoid".into();
    cfg["rope_interleave"] = true.into();
    if indexer_interleave {
        cfg["indexer_rope_interleave"] = true.into();
    }
    std::fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    out
}

/// A GGUF that llama.cpp's own tools made, at TP 2 on the CUDA tree:
/// * vllm-gguf-plugin 0.0.5 as released keeps rank 0's rows of every merged-column weight on
///   every rank (its loader narrows at a `tp_rank` vLLM 0.32 never passes): glmcheck locates it
///   in layer 0 and names the rows, the other half, and — through `glmcheck shards` — every
///   weight it reaches (the shared experts of each MoE layer), with no fault planted;
/// * with the plugin's fix, the run passes;
/// * served with a config that lost `indexer_rope_interleave`, vLLM's DSA indexer rotates its
///   keys half-split and chooses other keys: `indexer_mismatch` at layer 0's top-k.
#[test]
fn a_llama_cpp_imatrix_gguf_through_vllm_gguf_plugin_meets_its_tp_bug_and_passes_once_fixed() {
    let dir = common::scratch();
    let (gguf, hf) = llama_cpp_gguf(dir.path());
    let config = glm5_config(&hf, "glm5-config", true);
    let (out, _) = capture_served(
        &served_gguf(&gguf, &config, &[], ""),
        "cuda",
        2,
        "float32",
        None,
    );
    let v = bisect(&gguf, &out);
    let fault = &v["fault"];
    assert_eq!(fault["class"], "unsharded_weight", "{v:#}");
    assert_eq!(
        fault["weight"], "model.layers.0.mlp.gate_proj.weight",
        "{v:#}"
    );
    // The CUDA tree holds the MLP's output as partial sums: the first stage it shows whole
    // is the layer's output.
    assert_eq!(v["first_divergence"]["stage"], "L0.out", "{v:#}");
    let text = evidence(&v);
    for needle in [
        "model.layers.0.mlp.gate_proj.weight on rank 1 holds rows 0..256, the same block as \
         every rank; the plan gives rows 256..512",
        "the same on model.layers.0.mlp.up_proj.weight (rank 1)",
    ] {
        assert!(text.contains(needle), "{needle} not in: {text}");
    }
    // Every merged-column weight on rank 1, and nothing else: the dense MLP's halves and each
    // MoE layer's shared experts.
    let shards = shards_check(&gguf, &out);
    let mut wrong: Vec<(&str, &str, u64)> = shards["mismatches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            let (name, class) = (w["weight"].as_str(), w["class"].as_str());
            (name.unwrap(), class.unwrap(), w["rank"].as_u64().unwrap())
        })
        .collect();
    wrong.sort();
    let expected: Vec<String> = ["0.mlp", "1.mlp.shared_experts", "2.mlp.shared_experts"]
        .iter()
        .flat_map(|m| ["gate_proj", "up_proj"].map(|p| format!("model.layers.{m}.{p}.weight")))
        .collect();
    let expected: Vec<(&str, &str, u64)> = expected
        .iter()
        .map(|n| (n.as_str(), "unsharded_weight", 1))
        .collect();
    assert_eq!(wrong, expected);

    let fixed = served_gguf(&gguf, &config, WITH_RANK_FIX, "-fixed");
    let (out, _) = capture_served(&fixed, "cuda", 2, "float32", None);
    let v = bisect(&gguf, &out);
    assert_eq!(v["verdict"], "pass", "{v:#}");

    let half_split = glm5_config(&hf, "config-without-indexer-interleave", false);
    let served = served_gguf(&gguf, &half_split, WITH_RANK_FIX, "-half-split");
    let (out, _) = capture_served(&served, "cuda", 2, "float32", None);
    let v = bisect(&gguf, &out);
    assert_eq!(v["fault"]["class"], "indexer_mismatch", "{v:#}");
    assert_eq!(
        v["first_divergence"]["stage"], "L0.attn.index_topk",
        "{v:#}"
    );
}

/// With the plugin's fix, clean runs pass at TP 2 (CPU tree, f32) and TP 4 (CUDA tree, bf16);
/// the story's loader fault, `kv_b_proj` cut at rank 0's offset on every rank, is located and
/// classed at TP 4 with ranks and rows.
#[test]
fn with_the_plugins_fix_a_gguf_passes_at_tp2_and_tp4_and_the_unsharded_kv_b_is_found() {
    let dir = common::scratch();
    let (gguf, hf) = gguf_model(dir.path(), true);
    let served = served_gguf(&gguf, &hf, WITH_RANK_FIX, "-fixed");
    for (tree, tp, dtype) in [("cpu", 2, "float32"), ("cuda", 4, "bfloat16")] {
        let (out, _) = capture_served(&served, tree, tp, dtype, None);
        let v = bisect(&gguf, &out);
        assert_eq!(v["verdict"], "pass", "{tree} tree, TP {tp} {dtype}: {v:#}");
    }
    let (out, _) = capture_served(&served, "cuda", 4, "float32", Some("unsharded-kv-b"));
    let v = bisect(&gguf, &out);
    assert_eq!(v["fault"]["class"], "unsharded_weight", "{v:#}");
    assert_eq!(
        v["fault"]["weight"], "model.layers.0.self_attn.kv_b_proj.weight",
        "{v:#}"
    );
    assert_eq!(v["first_divergence"]["layer"], 0, "{v:#}");
    // 8 heads of (32 + 128) rows: every rank holds rank 0's 320.
    let text = evidence(&v);
    for rank in 1..4u64 {
        let needle = format!(
            "on rank {rank} holds rows 0..320 of 1280, the same block as every rank; the plan \
             gives rows {}..{}",
            rank * 320,
            (rank + 1) * 320
        );
        assert!(text.contains(&needle), "{needle} not in: {text}");
    }
}

/// The plugin's RowParallel split cuts bytes, not blocks: where o_proj's 256-wide rows (one
/// Q4_K block) are split in two, each rank holds half a block's bytes. glmcheck names the block
/// and the byte the plan's columns cut, on both ranks.
#[test]
fn o_proj_q4_k_blocks_cut_by_the_plugins_row_split_are_a_wrong_shard_layout() {
    let dir = common::scratch();
    let (gguf, hf) = gguf_model(dir.path(), false);
    let served = served_gguf(&gguf, &hf, WITH_RANK_FIX, "-fixed");
    let (out, _) = capture_served(&served, "cuda", 2, "float32", None);
    let v = bisect(&gguf, &out);
    assert_eq!(v["fault"]["class"], "wrong_shard_layout", "{v:#}");
    assert_eq!(
        v["fault"]["weight"], "model.layers.0.self_attn.o_proj.weight",
        "{v:#}"
    );
    // o_proj's output is partial sums in the CUDA tree, first seen whole in the residual.
    assert_eq!(v["first_divergence"]["stage"], "L0.attn_resid", "{v:#}");
    let text = evidence(&v);
    for (rank, bytes) in [(0, "0..72"), (1, "72..144")] {
        let needle = format!(
            "on rank {rank}: the plan's columns {} of 256 cut Q4_K blocks (256 elements, 144 \
             bytes): column 128 is element 128 of block 0; it holds bytes {bytes} of each row",
            if rank == 0 { "0..128" } else { "128..256" }
        );
        assert!(text.contains(&needle), "{needle} not in: {text}");
    }
}
