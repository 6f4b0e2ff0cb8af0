//! `glmcheck selftest`: every backend op against f64 on the CPU ([`OpsReport`]), the fault
//! matrix ([`FaultMatrixReport`]), or the CUDA kernels compiled ([`CompileReport`]); each as
//! JSON or as a terminal table with a summary.

use std::fmt::Write;
use std::path::PathBuf;

use comfy_table::Cell;
use serde::Serialize;

use super::sorted_keys;
use super::terminal::table;
use crate::compare::Status;
use crate::exec::selftest::Outcome;

/// Every op case on the backend against the same op in f64 on the CPU.
#[derive(Clone, Debug, Serialize)]
pub struct OpsReport {
    pub backend: &'static str,
    #[serde(serialize_with = "sorted_keys")]
    pub cases: Vec<Outcome>,
    /// The GPUs' names on a GPU backend.
    pub devices: Vec<String>,
    pub failed: usize,
    pub seed: u64,
    pub tp: usize,
}

/// The catalogue's faults planted on the backend and bisected.
#[derive(Debug, Serialize)]
pub struct FaultMatrixReport {
    pub backend: &'static str,
    pub cases: Vec<FaultCase>,
    /// Cases bisect did not diagnose as the catalogue says.
    pub missed: usize,
    pub tp: u64,
    /// The model the candidates ran.
    #[serde(skip)]
    pub model: PathBuf,
}

/// One planted fault (or none) at one dtype, and what bisect made of it.
#[derive(Debug, Serialize)]
pub struct FaultCase {
    pub class: Option<&'static str>,
    pub dtype: &'static str,
    pub expected_class: Option<&'static str>,
    /// Stages a correct diagnosis may name (any, when empty).
    pub expected_stages: Vec<String>,
    /// `clean` for the candidate without a fault.
    pub fault: String,
    pub ok: bool,
    pub stage: Option<String>,
    /// The largest `rel_diff` of any stage: how close a clean case came to its tolerance.
    pub tolerance_to_pass: f64,
    pub verdict: Status,
}

/// The CUDA kernels compiled for one architecture.
#[derive(Clone, Debug, Serialize)]
pub struct CompileReport {
    pub arch: String,
    pub kernels: Vec<CompiledKernel>,
}

/// One kernel source file's CUBIN.
#[derive(Clone, Debug, Serialize)]
pub struct CompiledKernel {
    pub cubin_bytes: usize,
    pub file: &'static str,
}

/// The op table under its backend, devices and seed, and how many cases pass.
pub fn ops_text(r: &OpsReport) -> String {
    let mut t = table(&["op", "shape", "dtype", "NMSE", "limit", "max |err|", ""]);
    for o in &r.cases {
        t.add_row(vec![
            Cell::new(o.op),
            Cell::new(&o.shape),
            Cell::new(o.dtype),
            Cell::new(format!("{:.2e}", o.nmse)),
            Cell::new(format!("{:.2e}", o.limit)),
            Cell::new(format!("{:.2e}", o.max_abs_err)),
            Cell::new(if o.pass { "ok" } else { "FAIL" }),
        ]);
    }
    let on = if r.devices.is_empty() {
        String::new()
    } else {
        format!(" on {}", r.devices.join(", "))
    };
    format!(
        "selftest: backend {}{on}, seed {}, against f64 on the CPU\n{t}\n{} of {} cases pass\n",
        r.backend,
        r.seed,
        r.cases.len() - r.failed,
        r.cases.len()
    )
}

/// The fault matrix's table: planted fault, dtype, what was expected and what bisect found.
pub fn faults_text(r: &FaultMatrixReport) -> String {
    let mut t = table(&[
        "fault",
        "dtype",
        "expected",
        "found stage",
        "class",
        "tolerance to pass",
        "",
    ]);
    for c in &r.cases {
        let expected = match c.expected_class {
            None => "pass".to_string(),
            Some(class) if c.expected_stages.is_empty() => class.to_string(),
            Some(class) => format!("{class} at {}", c.expected_stages.join(" or ")),
        };
        t.add_row(vec![
            Cell::new(&c.fault),
            Cell::new(c.dtype),
            Cell::new(expected),
            Cell::new(c.stage.as_deref().unwrap_or("-")),
            Cell::new(c.class.unwrap_or("-")),
            Cell::new(format!("{:.1e}", c.tolerance_to_pass)),
            Cell::new(if c.ok { "ok" } else { "MISSED" }),
        ]);
    }
    format!(
        "fault matrix: backend {}, TP {}, {}\n{t}\n{} of {} cases diagnosed as the catalogue says\n",
        r.backend,
        r.tp,
        r.model.display(),
        r.cases.len() - r.missed,
        r.cases.len()
    )
}

/// A line per kernel source file with its CUBIN's size.
pub fn compile_text(r: &CompileReport) -> String {
    let mut out = String::new();
    for k in &r.kernels {
        let _ = writeln!(
            out,
            "{}: {} bytes of CUBIN for {}",
            k.file, k.cubin_bytes, r.arch
        );
    }
    out
}
