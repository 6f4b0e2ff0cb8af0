//! `glmcheck selftest [--backend cpu|cuda]`: every backend op on fresh random inputs against the
//! same op in f64 on the CPU, one table row per op, shape and dtype with its NMSE and limit; with
//! `--faults MODEL`, the fault catalogue planted and bisected on the backend.

use anyhow::{bail, Result};

use std::path::PathBuf;

use super::{one_of, Outcome};
use crate::any_backend::BackendKind;
use crate::dtype::Precision;
use crate::pipeline::fault_matrix::matrix;
use crate::pipeline::selftest::{compile, ops};
use crate::progress::progress;
use crate::report::selftest::{compile_text, faults_text, ops_text};

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

pub fn run(args: SelftestArgs) -> Result<Outcome> {
    if let Some(arch) = &args.compile_only {
        let report = compile(arch, args.cubin_dir.as_deref())?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{}", compile_text(&report));
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
        let bar = progress(0, args.json, "fault matrix");
        let report = matrix(model, args.backend, args.tp, &dtypes, &args.only, |what| {
            bar.set_message(what.to_string());
            bar.tick();
        })?;
        bar.finish_and_clear();
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            print!("{}", faults_text(&report));
        }
        return Ok(if report.missed == 0 {
            Outcome::Pass
        } else {
            Outcome::Fail
        });
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let report = ops(args.backend, &dtypes, args.tp as usize, seed)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", ops_text(&report));
    }
    Ok(if report.failed == 0 {
        Outcome::Pass
    } else {
        Outcome::Fail
    })
}
