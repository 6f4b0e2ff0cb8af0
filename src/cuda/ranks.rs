//! The tensor-parallel ranks: their GPUs opened, all in one process or one in each process of a
//! run, and the NCCL all-reduce and all-gather across them.

use std::sync::{Mutex, MutexGuard};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::nccl::{Comm, ReduceOp};

use super::device::{open_device, Device};
use super::dtype::Dtype;
use crate::dtype::Precision;
use crate::exec::mat::Mat;

/// The NCCL communicators of the ranks' GPUs, one per rank, made at once (ncclCommInitAll).
pub(super) struct Comms(Vec<Comm>);

// SAFETY: the communicators are only used under their mutex, from one thread at a time.
unsafe impl Send for Comms {}

/// Every rank's GPU.
pub(super) struct Ranks {
    /// The GPUs this process drives, one per rank of `local`.
    pub(super) devices: Vec<Mutex<Device>>,
    /// One communicator per local rank, in the same order.
    pub(super) comms: Option<Mutex<Comms>>,
    /// The tensor-parallel ranks this process computes: all of them, or its own.
    pub(super) local: Vec<usize>,
    pub(super) tp: usize,
}

/// One process of a run with a process per rank.
#[derive(Clone, Debug)]
pub struct ProcessRank {
    pub rank: usize,
    pub world_size: usize,
    /// Where rank 0 writes the NCCL unique id and the others read it.
    pub nccl_id: std::path::PathBuf,
    /// The longest any rank process waits for another (`--rank-timeout`).
    pub timeout: std::time::Duration,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether the precision runs on GPUs and cuBLAS (and, for several ranks, NCCL) can be loaded.
fn check_setup(precision: Precision, ranks: usize) -> Result<()> {
    if precision == Precision::F64 {
        bail!("--backend cuda runs f32, bf16 or f16, not f64");
    }
    super::libraries()?;
    // SAFETY: only tries to load the library by its usual names.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        bail!("no cuBLAS found (libcublas): put CUDA 13's libraries on LD_LIBRARY_PATH (scripts/gpu/gpu-env does)");
    }
    // SAFETY: as above.
    if ranks > 1 && !unsafe { cudarc::nccl::sys::is_culib_present() } {
        bail!(
            "no NCCL found (libnccl.so): --tp {ranks} on GPUs needs it (scripts/gpu/gpu-env links it)"
        );
    }
    Ok(())
}

impl Ranks {
    /// GPUs 0..`tp`, one per rank, at `precision` (f32, bf16 or f16).
    pub(super) fn open(precision: Precision, tp: usize) -> Result<Ranks> {
        check_setup(precision, tp)?;
        let visible = cudarc::driver::CudaContext::device_count()? as usize;
        if tp > visible {
            bail!("--tp {tp} on GPUs needs {tp} of them, one per rank; {visible} visible");
        }
        let devices = (0..tp)
            .map(|ordinal| open_device(ordinal, tp == 1))
            .collect::<Result<Vec<_>>>()?;
        let comms = if tp > 1 {
            let streams = devices.iter().map(|d| lock(d).gpu.stream.clone()).collect();
            let comms =
                Comm::from_devices(streams).map_err(|e| anyhow!("NCCL over {tp} GPUs: {e:?}"))?;
            Some(Mutex::new(Comms(comms)))
        } else {
            None
        };
        Ok(Ranks {
            devices,
            comms,
            local: (0..tp).collect(),
            tp,
        })
    }

    /// Rank `p.rank` of `p.world_size` in a process of its own, on GPU `rank` (modulo the GPUs
    /// visible), joined to the others through the NCCL id in `p.nccl_id` — the route to
    /// several nodes.
    pub(super) fn open_rank(precision: Precision, p: &ProcessRank) -> Result<Ranks> {
        let ProcessRank {
            rank, world_size, ..
        } = *p;
        if rank >= world_size {
            bail!("--rank {rank} is not below --world-size {world_size}");
        }
        check_setup(precision, world_size)?;
        let visible = cudarc::driver::CudaContext::device_count()? as usize;
        if visible == 0 {
            bail!("no CUDA GPU visible");
        }
        let device = open_device(rank % visible, false)?;
        let id = super::nccl_id::exchange(&p.nccl_id, rank, p.timeout)?;
        let stream = lock(&device).gpu.stream.clone();
        let comm = Comm::from_rank(stream, rank, world_size, id)
            .map_err(|e| anyhow!("NCCL rank {rank} of {world_size}: {e:?}"))?;
        Ok(Ranks {
            devices: vec![device],
            comms: Some(Mutex::new(Comms(vec![comm]))),
            local: vec![rank],
            tp: world_size,
        })
    }

    /// This rank's device, bound to the calling thread.
    pub(super) fn device(&self, rank: usize) -> Result<MutexGuard<'_, Device>> {
        let device = lock(&self.devices[rank]);
        device.bind()?;
        Ok(device)
    }

    /// The NCCL all-reduce of one part per rank, each on its rank's GPU, in the dtype.
    pub(super) fn nccl_all_reduce<D: Dtype>(
        &self,
        comms: &Comms,
        parts: &[Mat<f32>],
    ) -> Result<Mat<f32>> {
        let local = &self.local;
        let devices: Vec<MutexGuard<'_, Device>> = (0..local.len())
            .map(|d| self.device(d))
            .collect::<Result<_>>()?;
        let sends = devices
            .iter()
            .zip(local)
            .map(|(d, &r)| d.upload::<D>(parts[r].data()))
            .collect::<Result<Vec<_>>>()?;
        let n = parts[local[0]].len();
        let mut receives = devices
            .iter()
            .map(|d| d.alloc::<D>(n))
            .collect::<Result<Vec<_>>>()?;
        nccl_group(|| {
            comms
                .0
                .iter()
                .zip(&sends)
                .zip(&mut receives)
                .try_for_each(|((comm, send), receive)| {
                    comm.all_reduce(&*send.slice, &mut *receive.slice, &ReduceOp::Sum)
                        .map(|_| ())
                })
        })
        .context("NCCL all-reduce")?;
        let first = &parts[0];
        let sum = devices[0].download(&receives[0], n)?;
        Ok(Mat::new(first.rows, first.cols, sum))
    }

    /// This process's part and the other ranks' through an NCCL all-gather (every part has the
    /// shape of this rank's, as the plan gives them).
    pub(super) fn nccl_gather<D: Dtype>(
        &self,
        comms: &Comms,
        own: &Mat<f32>,
    ) -> Result<Vec<Mat<f32>>> {
        let device = self.device(0)?;
        let send = device.upload::<D>(own.data())?;
        let n = own.len();
        let tp = self.tp;
        let mut receive = device.alloc::<D>(n * tp)?;
        nccl_group(|| {
            comms.0[0]
                .all_gather(&*send.slice, &mut *receive.slice)
                .map(|_| ())
        })
        .context("NCCL all-gather")?;
        let all = device.download(&receive, n * tp)?;
        Ok(all
            .chunks(n.max(1))
            .take(tp)
            .map(|c| Mat::new(own.rows, own.cols, c.to_vec()))
            .collect())
    }
}

/// NCCL calls issued as one group (one thread drives every local communicator).
fn nccl_group(calls: impl FnOnce() -> Result<(), cudarc::nccl::result::NcclError>) -> Result<()> {
    cudarc::nccl::result::group_start().map_err(|e| anyhow!("{e:?}"))?;
    let issued = calls();
    let ended = cudarc::nccl::result::group_end();
    issued.map_err(|e| anyhow!("{e:?}"))?;
    ended.map_err(|e| anyhow!("{e:?}"))?;
    Ok(())
}
