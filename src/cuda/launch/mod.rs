//! The ops on one rank's GPU: launches of the kernels of `kernels/ops.cu` (norms, element-wise
//! ops, RoPE, attention, the DSA indexer's scores) and cuBLAS GEMMs, host matrices in and out.
//! This module holds the launch shapes and checks the parts share; each part is one kind of op.

use anyhow::{anyhow, bail, Result};
use cudarc::driver::LaunchConfig;

use super::device::Device;

mod elementwise;
mod gemm;
mod indexer;
mod mlp;
mod widen;

pub(super) use mlp::GpuMlp;

/// Threads per block of the row kernels (`ROW_THREADS` in `kernels/ops.cu`).
pub(super) const ROW_THREADS: u32 = 256;
/// Shared memory one attention or indexer block may use (the default limit per block is 48 KiB).
pub(super) const MAX_SCORES_BYTES: u32 = 40 << 10;
/// Threads per block of the element-wise kernels.
const ELEMENT_THREADS: u32 = 256;

impl Device {
    pub(super) fn kernel(&self, op: &str, suffix: &str) -> Result<cudarc::driver::CudaFunction> {
        self.gpu.ops_kernel(&format!("{op}_{suffix}"))
    }
}

pub(super) fn elements(count: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (count.div_ceil(ELEMENT_THREADS), 1, 1),
        block_dim: (ELEMENT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn to_u32(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| anyhow!("{n} is past a kernel's 2^32 - 1 limit"))
}

pub(super) fn to_i32(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| anyhow!("{n} is past cuBLAS's 2^31 - 1 limit"))
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        bail!("{what} has {got} values for {want} columns");
    }
    Ok(())
}
