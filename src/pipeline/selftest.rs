//! `glmcheck selftest`: every backend op against f64 on the CPU ([`ops`]), and the CUDA kernels
//! compiled without a GPU ([`compile`]). The fault matrix is [`fault_matrix`](super::fault_matrix).

use std::path::Path;

use anyhow::{Context, Result};

use crate::any_backend::{AnyBackend, BackendKind};
use crate::dtype::Precision;
use crate::exec::selftest;
use crate::report::selftest::{CompileReport, CompiledKernel, OpsReport};

/// Every op case on `backend` at each of `dtypes` with `tp` ranks, from random seed `seed` (the
/// next seed for each further dtype).
pub fn ops(backend: BackendKind, dtypes: &[Precision], tp: usize, seed: u64) -> Result<OpsReport> {
    let mut cases = Vec::new();
    let mut devices = Vec::new();
    for (i, &dtype) in dtypes.iter().enumerate() {
        let engine = AnyBackend::open(backend, dtype, tp, None)?;
        if let AnyBackend::Cuda(gpus) = &engine {
            devices = gpus.device_names();
        }
        cases.extend(selftest::run(&engine, tp, seed.wrapping_add(i as u64))?);
    }
    Ok(OpsReport {
        backend: backend.name(),
        failed: cases.iter().filter(|o| !o.pass).count(),
        cases,
        devices,
        seed,
        tp,
    })
}

/// Every kernel source compiled by NVRTC for `arch` (`sm_90`); with `cubin_dir`, each CUBIN
/// written there as `FILE.cubin`.
pub fn compile(arch: &str, cubin_dir: Option<&Path>) -> Result<CompileReport> {
    let compiled = crate::cuda::compile_kernels(arch)?;
    let mut kernels = Vec::new();
    for (file, cubin) in compiled {
        if let Some(dir) = cubin_dir {
            let path = dir.join(format!("{file}.cubin"));
            std::fs::write(&path, &cubin).with_context(|| path.display().to_string())?;
        }
        kernels.push(CompiledKernel {
            cubin_bytes: cubin.len(),
            file,
        });
    }
    Ok(CompileReport {
        arch: arch.to_string(),
        kernels,
    })
}
