//! `glmcheck selftest [--backend cpu|cuda]`: every backend op on fresh random inputs against the
//! same op in f64 on the CPU, one table row per op, shape and dtype with its NMSE and limit; with
//! `--faults MODEL`, the fault catalogue planted and bisected on the backend.

use anyhow::{bail, Context, Result};
use comfy_table::Cell;
use serde_json::json;

use std::path::{Path, PathBuf};

use super::output::{progress, table};
use super::{one_of, Outcome};
use crate::any_backend::{AnyBackend, BackendKind};
use crate::dtype::Precision;
use crate::exec::selftest;
use crate::pipeline::fault_matrix;

#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// The backend under test.
    #[arg(long, default_value = "cpu", value_parser = one_of(&BackendKind::ALL, BackendKind::name))]
    pub backend: BackendKind,
    /// Dtypes to test (comma-separated); default f32, bf16 and f16.
    #[arg(long, value_delimiter = ',', value_parser = one_of(&Precision::ALL, Precision::name))]
    pub dtype: Vec<Precision>,
    /// Ranks for the all-reduce case (GPUs 0..TP with `--backend cuda`); 1 leaves it out.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: u64,
    /// Seed of the random inputs (default: from the clock; the table says which).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Only compile the CUDA kernels for this architecture (`sm_90`) with NVRTC and stop: checks
    /// the embedded sources on a machine without a GPU.
    #[arg(long, value_name = "ARCH")]
    pub compile_only: Option<String>,
    /// With `--compile-only`: also write each file's CUBIN to DIR/FILE.cubin (say, for
    /// `cuobjdump -sass`).
    #[arg(long, value_name = "DIR", requires = "compile_only")]
    pub cubin_dir: Option<PathBuf>,
    /// Instead of the ops: plant every catalogue fault in turn (and none) in a candidate of
    /// MODEL on the backend at `--tp` and each dtype, and check that `bisect` names its class at
    /// its stage (and passes the clean one). On `cuda`, also bisect a clean CPU candidate at f32
    /// against the reference run on the GPU (`bisect --reference-backend cuda`): it must pass
    /// at f32's tolerance.
    #[arg(long, value_name = "MODEL")]
    pub faults: Option<PathBuf>,
    /// With `--faults`: only these catalogue faults (comma-separated names), and no clean runs.
    #[arg(
        long = "fault",
        value_name = "NAME",
        value_delimiter = ',',
        requires = "faults"
    )]
    pub only: Vec<String>,
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// The fault matrix on the backend: a table of planted fault, dtype, where and what bisect
/// found.
fn fault_matrix(args: &SelftestArgs, model: &Path, dtypes: &[Precision]) -> Result<Outcome> {
    let bar = progress(0, args.json, "fault matrix");
    let cases = fault_matrix::matrix(model, args.backend, args.tp, dtypes, &args.only, |what| {
        bar.set_message(what.to_string());
        bar.tick();
    })?;
    bar.finish_and_clear();
    let missed = cases.iter().filter(|c| !c.ok).count();
    if args.json {
        println!(
            "{}",
            json!({"backend": args.backend.name(), "tp": args.tp, "cases": cases, "missed": missed})
        );
    } else {
        let mut t = table(&[
            "fault",
            "dtype",
            "expected",
            "found stage",
            "class",
            "tolerance to pass",
            "",
        ]);
        for c in &cases {
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
        println!(
            "fault matrix: backend {}, TP {}, {}",
            args.backend.name(),
            args.tp,
            model.display()
        );
        println!("{t}");
        println!(
            "{} of {} cases diagnosed as the catalogue says",
            cases.len() - missed,
            cases.len()
        );
    }
    Ok(if missed == 0 {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}

pub fn run(args: SelftestArgs) -> Result<Outcome> {
    if let Some(arch) = &args.compile_only {
        let compiled = crate::cuda::compile_kernels(arch)?;
        for (file, cubin) in &compiled {
            if let Some(dir) = &args.cubin_dir {
                let path = dir.join(format!("{file}.cubin"));
                std::fs::write(&path, cubin).with_context(|| path.display().to_string())?;
            }
            if !args.json {
                println!("{file}: {} bytes of CUBIN for {arch}", cubin.len());
            }
        }
        if args.json {
            let files: Vec<_> = compiled
                .iter()
                .map(|(f, c)| json!({"file": f, "cubin_bytes": c.len()}))
                .collect();
            println!("{}", json!({"arch": arch, "kernels": files}));
        }
        return Ok(Outcome::Pass);
    }
    let dtypes = if args.dtype.is_empty() {
        vec![Precision::F32, Precision::Bf16, Precision::F16]
    } else {
        args.dtype.clone()
    };
    if dtypes.contains(&Precision::F64) {
        bail!("--dtype f64 is the reference itself; test f32, bf16 or f16");
    }
    if let Some(model) = &args.faults {
        return fault_matrix(&args, model, &dtypes);
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let ranks = args.tp as usize;
    let mut outcomes = Vec::new();
    let mut devices = Vec::new();
    for (i, &dtype) in dtypes.iter().enumerate() {
        let engine = AnyBackend::open(args.backend, dtype, ranks, None)?;
        if let AnyBackend::Cuda(gpus) = &engine {
            devices = gpus.device_names();
        }
        outcomes.extend(selftest::run(&engine, ranks, seed.wrapping_add(i as u64))?);
    }
    let failed = outcomes.iter().filter(|o| !o.pass).count();
    if args.json {
        println!(
            "{}",
            json!({"backend": args.backend.name(), "devices": devices, "seed": seed, "tp": ranks,
                   "cases": outcomes, "failed": failed})
        );
    } else {
        let mut t = table(&["op", "shape", "dtype", "NMSE", "limit", "max |err|", ""]);
        for o in &outcomes {
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
        let on = if devices.is_empty() {
            String::new()
        } else {
            format!(" on {}", devices.join(", "))
        };
        println!(
            "selftest: backend {}{on}, seed {seed}, against f64 on the CPU",
            args.backend.name()
        );
        println!("{t}");
        println!(
            "{} of {} cases pass",
            outcomes.len() - failed,
            outcomes.len()
        );
    }
    Ok(if failed == 0 {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
