//! A recorded stage's statistics taken on the GPU that holds its values (the `stage_*` kernels
//! of `kernels/ops.cu`): the kernels and the copies of their partial sums and hash lanes into
//! page-locked memory are queued behind the op that made the values, and the host merges them as
//! it merges its own (`trace::stats`) only when the trace writer asks, so the numbers are the
//! host's bit for bit while neither the values nor the forward wait for the bus.

use std::sync::Arc;

use anyhow::{bail, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use super::dtype::Dtype;
use super::memory::{Pinned, Staging};
use super::Gpu;
use crate::trace::stats::{
    content_hash_of_pieces, merge_lanes, moments_of_lanes, StatsLater, TensorStats, HASH_LANES,
    HASH_PIECE_BYTES, LANE_COUNTS, LANE_SUMS, MOMENT_LANES, TASK,
};

/// Threads per block of the statistics kernels: a hash piece's lanes (`HASH_LANES`).
const STATS_THREADS: u32 = 256;

/// The partial results on the GPU, in the order they land in the page-locked buffer (8 bytes a
/// value each).
struct Partials {
    counts: CudaSlice<u64>,
    sums: CudaSlice<f64>,
    hash_lanes: CudaSlice<u64>,
    deviations: CudaSlice<f64>,
    mean: CudaSlice<f64>,
}

/// Where a stage's statistics are taken: its GPU, the side stream they run on, and the
/// page-locked buffers their partials come back through.
pub(super) struct StatsOn {
    pub(super) gpu: Gpu,
    pub(super) side: Arc<CudaStream>,
    pub(super) staging: Arc<Staging>,
}

/// The statistics and content hash of the first `n` values of `x`, as the host computes them of
/// the same values widened to f32: queued now on the side stream behind everything queued on
/// the forward's stream so far, finished when called; `values` (what holds `x`) is kept until
/// then.
pub(super) fn stage_stats<D: Dtype, V: Send + 'static>(
    on: StatsOn,
    x: &CudaSlice<D>,
    n: usize,
    values: V,
) -> Result<StatsLater> {
    if n == 0 {
        let none = TensorStats::of::<f32>(&[]);
        return Ok(Box::new(move || Ok(none)));
    }
    let StatsOn { gpu, side, staging } = on;
    side.context().bind_to_thread()?;
    side.wait(&gpu.stream.record_event(None)?)?;
    let (count, chunks) = (n as u64, n.div_ceil(TASK));
    let lanes = chunks * MOMENT_LANES;
    let bytes = n * 4;
    let pieces = bytes.div_ceil(HASH_PIECE_BYTES);
    let mut p = Partials {
        counts: side.alloc_zeros(lanes * LANE_COUNTS)?,
        sums: side.alloc_zeros(lanes * LANE_SUMS)?,
        hash_lanes: side.alloc_zeros(pieces * HASH_LANES)?,
        deviations: side.alloc_zeros(lanes)?,
        mean: side.alloc_zeros(1)?,
    };
    let kernel = |name: &str| gpu.ops_kernel(&format!("{name}_{}", D::SUFFIX));
    let f = kernel("stage_sums")?;
    let mut launch = side.launch_builder(&f);
    launch
        .arg(x)
        .arg(&count)
        .arg(&mut p.counts)
        .arg(&mut p.sums);
    // SAFETY: a block per chunk, its lanes writing their own slots of buffers sized for every
    // lane; `x` holds at least `n` values (callers pass its length or less).
    unsafe { launch.launch(blocks(chunks)) }?;
    let f = kernel("stage_hash_lanes")?;
    let mut launch = side.launch_builder(&f);
    launch.arg(x).arg(&count).arg(&mut p.hash_lanes);
    // SAFETY: a block per piece, a thread per lane writing its own slot.
    unsafe { launch.launch(blocks(pieces)) }?;
    let f = gpu.ops_kernel("stage_mean")?;
    let chunk_count = chunks as u64;
    let mut launch = side.launch_builder(&f);
    launch
        .arg(&p.counts)
        .arg(&p.sums)
        .arg(&chunk_count)
        .arg(&mut p.mean);
    // SAFETY: one block reading every chunk's lanes, its first thread writing the one mean.
    unsafe { launch.launch(blocks(1)) }?;
    let f = kernel("stage_deviations")?;
    let mut launch = side.launch_builder(&f);
    launch
        .arg(x)
        .arg(&count)
        .arg(&p.mean)
        .arg(&mut p.deviations);
    // SAFETY: as the sums, a block per chunk.
    unsafe { launch.launch(blocks(chunks)) }?;

    let words = [
        p.counts.len(),
        p.sums.len(),
        p.hash_lanes.len(),
        p.deviations.len(),
        1,
    ];
    let bytes_back = words.iter().sum::<usize>() * 8;
    let mut pinned = staging.take(bytes_back);
    let host: &mut [u64] = bytemuck::cast_slice_mut(pinned.bytes(&gpu, bytes_back)?);
    let (counts_h, rest) = host.split_at_mut(words[0]);
    let (sums_h, rest) = rest.split_at_mut(words[1]);
    let (hash_h, rest) = rest.split_at_mut(words[2]);
    let (dev_h, mean_h) = rest.split_at_mut(words[3]);
    copy_back(&side, &p.counts, counts_h)?;
    copy_back(&side, &p.sums, bytemuck::cast_slice_mut(sums_h))?;
    copy_back(&side, &p.hash_lanes, hash_h)?;
    copy_back(&side, &p.deviations, bytemuck::cast_slice_mut(dev_h))?;
    copy_back(&side, &p.mean, bytemuck::cast_slice_mut(mean_h))?;
    let landed = side.record_event(None)?;
    Ok(Box::new(move || {
        // The writing thread finishes it: the GPU's context bound there for the wait and for
        // freeing the partials.
        side.context().bind_to_thread()?;
        landed.synchronize()?;
        let finished = finish(&pinned, &words, n);
        drop((p, values));
        staging.give(pinned);
        finished
    }))
}

/// The statistics from the partials landed in `pinned` (laid out as `words` says).
fn finish(pinned: &Pinned, words: &[usize; 5], n: usize) -> Result<TensorStats> {
    let host: &[u64] = bytemuck::cast_slice(pinned.landed(words.iter().sum::<usize>() * 8)?);
    let (counts, rest) = host.split_at(words[0]);
    let (sums, rest) = rest.split_at(words[1]);
    let (hash_lanes, rest) = rest.split_at(words[2]);
    let (deviations, mean) = rest.split_at(words[3]);
    let sums: &[f64] = bytemuck::cast_slice(sums);
    let deviations: &[f64] = bytemuck::cast_slice(deviations);
    let device_mean = f64::from_bits(mean[0]);
    let stats = moments_of_lanes(n, counts, sums, |mean| {
        // The deviations were taken from the GPU's mean: it must be the host's, bit for bit.
        if mean.to_bits() != device_mean.to_bits() {
            bail!("the GPU's mean {device_mean:e} is not the host's {mean:e}");
        }
        Ok(deviations.to_vec())
    })?;
    let bytes = n * 4;
    let piece_hashes: Vec<u64> = hash_lanes
        .chunks_exact(HASH_LANES)
        .enumerate()
        .map(|(p, lanes)| {
            let len = HASH_PIECE_BYTES.min(bytes - p * HASH_PIECE_BYTES);
            merge_lanes(lanes.try_into().expect("a piece's lanes"), len)
        })
        .collect();
    Ok(TensorStats {
        hash: content_hash_of_pieces(&piece_hashes, bytes),
        ..stats
    })
}

/// `src` copied into `host` on `stream`, not waited for.
fn copy_back<T: DeviceRepr>(stream: &CudaStream, src: &CudaSlice<T>, host: &mut [T]) -> Result<()> {
    let (ptr, _record) = src.device_ptr(stream);
    // SAFETY: `host` is page-locked and holds `src.len()` values; it is read only after the
    // event recorded behind this copy, and `src` lives until then.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(host, ptr, stream.cu_stream()) }?;
    Ok(())
}

/// `count` blocks of [`STATS_THREADS`] threads (`STATS_THREADS` of `kernels/ops.cu`).
fn blocks(count: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (count as u32, 1, 1),
        block_dim: (STATS_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}
