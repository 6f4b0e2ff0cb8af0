//! The CUDA side on a machine without a GPU, as every machine with a Rust toolchain here is:
//! every CUDA command says that no CUDA driver was found and exits 2 — it neither panics nor
//! pretends; the embedded kernels compile with NVRTC (the one torch's CUDA wheels carry) for the
//! GPU generations users run, with every dequantization kernel the host loads; the CPU backend
//! passes its own selftest. The GPU checks themselves
//! run on the GPU machine (`just gpu-backend-check`, `just gpu-dequant-check`).

use crate::common;

use std::path::PathBuf;
use std::process::{Command, Output};

use glmcheck::cuda::{dequant_kernel, DequantOutput};
use glmcheck::weights::GgmlType;
use half::{bf16, f16};

fn says_no_driver(out: &Output, what: &str) {
    assert_eq!(out.status.code(), Some(2), "{what}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CUDA driver found"), "{what}: {err}");
    assert_eq!(err.lines().count(), 1, "{what}: one line: {err}");
}

/// A scratch folder with a tiny Q8_0 model `m.gguf`; the path of a trace `r.trace` beside it.
fn tiny_model() -> (tempfile::TempDir, String, std::path::PathBuf) {
    let dir = common::scratch();
    let model = dir.path().join("m.gguf");
    common::synth_tiny(&model, &["--quant", "q8_0"]);
    let trace = dir.path().join("r.trace");
    (dir, model.to_str().unwrap().to_string(), trace)
}

#[test]
fn without_a_driver_cuda_commands_say_so() {
    let (_dir, m, trace) = tiny_model();
    let (m, t) = (m.as_str(), trace.to_str().unwrap());
    says_no_driver(
        &common::glmcheck_output(&["dequant", m, "--device", "cuda"]),
        "dequant",
    );
    says_no_driver(
        &common::glmcheck_output(&["run", m, "--tokens", "1,2", "--backend", "cuda", "--out", t]),
        "run",
    );
    says_no_driver(
        &common::glmcheck_output(&[
            "bisect",
            m,
            "--tokens",
            "1,2",
            "--backend",
            "cuda",
            "--tp",
            "2",
        ]),
        "bisect",
    );
    says_no_driver(
        &common::glmcheck_output(&[
            "bisect",
            m,
            "--tokens",
            "1,2",
            "--reference-backend",
            "cuda",
        ]),
        "bisect with the reference on the GPU",
    );
    says_no_driver(
        &common::glmcheck_output(&["selftest", "--backend", "cuda"]),
        "selftest",
    );
}

/// The folder of the NVRTC library in the oracle venv's CUDA wheels.
fn nvrtc_dir() -> PathBuf {
    let out = Command::new(common::python())
        .args([
            "-c",
            "import glob, site; print(next(d for s in site.getsitepackages() \
             for d in glob.glob(s + '/nvidia/cu13/lib') if glob.glob(d + '/libnvrtc.so*')))",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "no NVRTC in the oracle venv's nvidia/cu13 wheels: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Whether the ELF image `cubin` names kernel `name`: its symbol and section names are
/// NUL-terminated strings in it.
fn names(cubin: &[u8], name: &str) -> bool {
    let name = format!("{name}\0");
    cubin.windows(name.len()).any(|w| w == name.as_bytes())
}

/// `glmcheck selftest --compile-only ARGS` with `lib` as the library path.
fn compile_only(args: &[&str], lib: &std::ffi::OsStr) -> std::process::Output {
    Command::new(common::glmcheck_bin())
        .args(["selftest", "--compile-only"])
        .args(args)
        .env("LD_LIBRARY_PATH", lib)
        .output()
        .unwrap()
}

/// [`compile_only`] with NVRTC on the path: its output, after checking that it succeeded.
fn compiled(args: &[&str]) -> Vec<u8> {
    let out = compile_only(args, nvrtc_dir().as_os_str());
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn the_embedded_kernels_compile_for_ampere_hopper_and_blackwell() {
    for arch in ["sm_80", "sm_90", "sm_100"] {
        let out = compiled(&[arch, "--json"]);
        let j: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let files: Vec<&str> = j["kernels"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k["file"].as_str().unwrap())
            .collect();
        assert_eq!(files, ["dequant.cu", "ops.cu"], "{arch}");
        for k in j["kernels"].as_array().unwrap() {
            // A CUBIN holds an ELF image of the kernels, tens of KB for these files.
            assert!(k["cubin_bytes"].as_u64().unwrap() > 10_000, "{arch}: {k}");
        }
    }
    // Every dequantization kernel the host loads, each type to each output, is in the CUBIN.
    let dir = common::scratch();
    compiled(&["sm_90", "--cubin-dir", dir.path().to_str().unwrap()]);
    let cubin = std::fs::read(dir.path().join("dequant.cu.cubin")).unwrap();
    let bases: Vec<&str> = GgmlType::all().filter_map(dequant_kernel).collect();
    assert_eq!(bases.len(), 15, "{bases:?}");
    for base in bases {
        for suffix in [f32::SUFFIX, bf16::SUFFIX, f16::SUFFIX] {
            let name = format!("{base}_{suffix}");
            assert!(names(&cubin, &name), "{name} is not in the CUBIN");
        }
    }
    assert!(!names(&cubin, "dq_q4_k"), "only the kernels per output");
    // An architecture NVRTC does not know: its complaint, on one line.
    let out = compile_only(&["sm_xx"], nvrtc_dir().as_os_str());
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("invalid value for --gpu-architecture"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    // Without NVRTC on the path: one line saying what is missing.
    let out = compile_only(&["sm_90"], "/nonexistent".as_ref());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no NVRTC found"));
}

#[test]
fn the_cpu_backend_passes_its_selftest_with_an_all_reduce() {
    let out = common::glmcheck_output(&["selftest", "--tp", "3", "--seed", "11", "--json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cases = j["cases"].as_array().unwrap();
    // Every case of the table (the all-reduce included) at each of f32, bf16 and f16, but the
    // statistics taken on a device, which the CPU has not.
    let device_only = glmcheck::exec::selftest::CASES
        .iter()
        .filter(|op| op.name() == "stats")
        .count();
    assert!(device_only > 0);
    assert_eq!(
        cases.len(),
        3 * (glmcheck::exec::selftest::CASES.len() - device_only)
    );
    assert!(cases.iter().all(|c| c["op"] != "stats"));
    for op in ["all_reduce", "mlp", "indexer_scores", "attention_dsa"] {
        let n = cases.iter().filter(|c| c["op"] == op).count();
        assert!(n >= 3, "{op}: {n} cases");
    }
    assert_eq!(j["failed"], 0);
    for c in cases {
        assert!(
            c["nmse"].as_f64().unwrap() <= c["limit"].as_f64().unwrap(),
            "{c}"
        );
    }
    let out = common::glmcheck_output(&["selftest", "--dtype", "f64"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_process_per_rank_needs_its_arguments_and_the_gpus() {
    let (dir, m, trace) = tiny_model();
    let id = dir.path().join("nccl.id");
    let (m, id, t) = (m.as_str(), id.to_str().unwrap(), trace.to_str().unwrap());
    // `run` at TP 2 with `extra`, as rank `rank` of `world` processes.
    let run = |extra: &[&str], rank: &str, world: &str| {
        let base = ["run", m, "--tokens", "1,2", "--tp", "2", "--out", t];
        let process = ["--rank", rank, "--world-size", world, "--nccl-id", id];
        common::glmcheck_output(&[&base[..], extra, &process].concat())
    };
    let cuda = ["--backend", "cuda"];
    // --rank without --world-size and --nccl-id: a usage error.
    let out = common::glmcheck_output(&[
        "run",
        m,
        "--tokens",
        "1,2",
        "--tp",
        "2",
        "--out",
        t,
        "--backend",
        "cuda",
        "--rank",
        "0",
    ]);
    assert_eq!(out.status.code(), Some(2));
    // On the CPU, with EP, or with another world size: refused, naming the rule.
    for out in [
        run(&[], "1", "2"),
        run(&[&cuda[..], &["--ep"]].concat(), "1", "2"),
        run(&cuda, "0", "4"),
    ] {
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--rank") || err.contains("--world-size"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // Right arguments, the other rank never started: the ranks meet before any GPU is touched,
    // so this rank stops within --rank-timeout naming the one missing (then, with every rank
    // there, a machine without a GPU says its driver is missing, as above).
    let alone = run(&[&cuda[..], &["--rank-timeout", "1"]].concat(), "1", "2");
    assert_eq!(alone.status.code(), Some(2));
    let err = String::from_utf8_lossy(&alone.stderr);
    assert!(err.contains("rank 0 did not arrive"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(!trace.exists(), "no trace folder left behind");
}

/// `scripts/gpu/gpu-kernel-times --table` on an Nsight Compute per-kernel summary (its format: a
/// header line per kernel with its launches, then the metric's minimum, maximum and average):
/// milliseconds a pass per group, the warm-up's dequantization whole, the statistics apart from
/// the forward's stream.
#[test]
fn the_kernel_times_script_groups_a_summary_by_pass() {
    let metric = |unit: &str, average: &str| {
        format!(
            "    Section: Command line profiler metrics\n    Metric Name Metric Unit Minimum Maximum Average\n    gpu__time_duration.sum          {unit}  1.00  2.00  {average}\n"
        )
    };
    let summary = [
        "  void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_bf16_grouped_128x64_64x3_align8>(T1::Params) (264, 1, 1)x(128, 1, 1), Device 0, CC 9.0, Invocations 4\n".to_string(),
        metric("us", "250.00"),
        "  stage_sums_hash_bf16 (60, 1, 1)x(256, 1, 1), Device 0, CC 9.0, Invocations 2\n".into(),
        metric("us", "150.00"),
        "  dq_q4_k_bf16 (3072, 1, 1)x(256, 1, 1), Device 0, CC 9.0, Invocations 10\n".into(),
        metric("us", "12.50"),
        "  rms_norm_bf16 (512, 1, 1)x(256, 1, 1), Device 0, CC 9.0, Invocations 8\n".into(),
        metric("ns", "5,000.00"),
    ]
    .concat();
    let dir = common::scratch();
    let path = dir.path().join("ncu.txt");
    std::fs::write(&path, summary).unwrap();
    let out = Command::new("python3")
        .args(["scripts/gpu/gpu-kernel-times", "--table"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let table = String::from_utf8(out.stdout).unwrap();
    let row = |group: &str| {
        table
            .lines()
            .find(|l| l.starts_with(&format!("| {group} |")))
            .unwrap_or_else(|| panic!("no row {group} in\n{table}"))
            .to_string()
    };
    // 4 launches of 0.25 ms over two passes: 0.5 ms a pass.
    assert_eq!(
        row("routed experts' grouped GEMMs"),
        "| routed experts' grouped GEMMs | 0.50 (4) |"
    );
    assert_eq!(
        row("statistics (side stream)"),
        "| statistics (side stream) | 0.15 (2) |"
    );
    assert_eq!(
        row("dequantization (warm-up pass)"),
        "| dequantization (warm-up pass) | 0.12 (10) |"
    );
    assert_eq!(row("the rest"), "| the rest | 0.02 (8) |");
    assert_eq!(
        row("the forward's stream, a pass"),
        "| the forward's stream, a pass | 0.52 |"
    );
}
