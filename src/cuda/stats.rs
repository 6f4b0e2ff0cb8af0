//! A recorded stage's statistics taken on the GPU that holds its values (the `stage_*` kernels
//! of `kernels/ops.cu`): the kernels and the copies of their partial sums and hash lanes into
//! page-locked memory are queued behind the op that made the values, and the host merges them as
//! it merges its own (`trace::stats`) only when the trace writer asks, so the numbers are the
//! host's bit for bit while neither the values nor the forward wait for the bus.

use std::sync::Arc;

use anyhow::{bail, Result};
use cudarc::driver::{
    CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};

use super::dtype::Dtype;
use super::memory::{FreeList, Meter, Pinned, Staging};
use super::Gpu;
use crate::exec::mat::{FetchLater, Queue};
use crate::trace::stats::{
    content_hash_of_pieces, merge_lanes, merge_sketches, moments_of_lanes, StatsLater, TensorStats,
    HASH_LANES, HASH_PIECE_BYTES, LANE_COUNTS, LANE_SUMS, MOMENT_LANES, SKETCH_BUCKETS, TASK,
};

/// Threads per block of the statistics kernels: a hash piece's lanes (`HASH_LANES`).
const STATS_THREADS: u32 = 256;

/// The partial results, one 8-byte word a value, in one device buffer and in the same order in
/// the page-locked one they are copied back into: one allocation and one copy a stage instead
/// of one each (a stage's driver calls are the cost at small prompts, not its bytes).
struct Layout {
    /// Chunks of `TASK` values (a block each) and hash pieces (a block each).
    chunks: usize,
    pieces: usize,
    /// Words of the counts, the sums, the hash lanes, the deviations, the one mean and the
    /// chunks' sketches.
    words: [usize; 6],
}

impl Layout {
    const COUNTS: usize = 0;
    const SUMS: usize = 1;
    const HASH_LANES: usize = 2;
    const DEVIATIONS: usize = 3;
    const MEAN: usize = 4;
    const SKETCH: usize = 5;

    fn of(n: usize) -> Layout {
        let chunks = n.div_ceil(TASK);
        let lanes = chunks * MOMENT_LANES;
        let pieces = (n * 4).div_ceil(HASH_PIECE_BYTES);
        Layout {
            chunks,
            pieces,
            words: [
                lanes * LANE_COUNTS,
                lanes * LANE_SUMS,
                pieces * HASH_LANES,
                lanes,
                1,
                chunks * SKETCH_BUCKETS,
            ],
        }
    }

    fn total(&self) -> usize {
        self.words.iter().sum()
    }

    /// Where part `part` starts, in words.
    fn offset(&self, part: usize) -> usize {
        self.words[..part].iter().sum()
    }

    /// Part `part` of the landed words.
    fn part<'a>(&self, all: &'a [u64], part: usize) -> &'a [u64] {
        let at = self.offset(part);
        &all[at..at + self.words[part]]
    }
}

/// Where a stage's statistics are taken: its GPU, the side stream they run on, and the
/// page-locked buffers their partials come back through.
pub(super) struct StatsOn {
    pub(super) gpu: Gpu,
    pub(super) side: Arc<CudaStream>,
    pub(super) staging: Arc<Staging>,
    /// Where the partials' device memory comes from and is counted (the values' GPU's).
    pub(super) free: Arc<FreeList>,
    pub(super) meter: Arc<Meter>,
}

impl StatsOn {
    /// The side stream, bound to this thread, ordered behind everything queued on the
    /// forward's stream so far.
    fn behind_the_forward(&self) -> Result<()> {
        self.side.context().bind_to_thread()?;
        self.gpu.mark.record(&self.gpu.stream)?;
        self.side.wait(&self.gpu.mark)?;
        Ok(())
    }
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
    on.behind_the_forward()?;
    let StatsOn {
        gpu,
        side,
        staging,
        free,
        meter,
    } = on;
    let layout = Layout::of(n);
    let (count, chunks) = (n as u64, layout.chunks as u64);
    // Every word is written by the kernels: no zeroing.
    let mut partials = free.buffer::<u64>(&meter, layout.total())?;
    {
        // The kernels take the parts as pointers into the one buffer.
        let (base, _record) = partials.slice.device_ptr_mut(&side);
        let at = |part: usize| base + (layout.offset(part) * 8) as u64;
        let (counts, sums, hash_lanes) =
            (at(Layout::COUNTS), at(Layout::SUMS), at(Layout::HASH_LANES));
        let (deviations, mean) = (at(Layout::DEVIATIONS), at(Layout::MEAN));
        let sketch = at(Layout::SKETCH);
        let kernel = |name: &str| gpu.ops_kernel(&format!("{name}_{}", D::SUFFIX));
        let f = kernel("stage_sums_hash")?;
        let mut launch = side.launch_builder(&f);
        launch
            .arg(x)
            .arg(&count)
            .arg(&chunks)
            .arg(&counts)
            .arg(&sums)
            .arg(&sketch)
            .arg(&hash_lanes);
        // SAFETY: a block per chunk, its lanes writing their own slots of parts sized for
        // every lane, then a block per piece, a thread per lane writing its own slot; `x` holds
        // at least `n` values (callers pass its length or less).
        unsafe { launch.launch(blocks(layout.chunks + layout.pieces)) }?;
        let f = kernel("stage_deviations")?;
        let mut launch = side.launch_builder(&f);
        launch
            .arg(x)
            .arg(&count)
            .arg(&counts)
            .arg(&sums)
            .arg(&chunks)
            .arg(&mean)
            .arg(&deviations);
        // SAFETY: a block per chunk, each reading every chunk's lanes and writing its own.
        unsafe { launch.launch(blocks(layout.chunks)) }?;
    }
    let bytes_back = layout.total() * 8;
    let mut pinned = staging.take(bytes_back);
    copy_back(
        &side,
        &*partials.slice,
        bytemuck::cast_slice_mut(pinned.bytes(&gpu, bytes_back)?),
    )?;
    let landing = Landing::new(side, (pinned, partials, values))?;
    Ok(Box::new(move || {
        // The writing thread finishes it (the context bound there by the wait, for freeing the
        // partials too).
        let (pinned, partials, values) = landing.wait()?;
        let finished = finish(&pinned, &layout, n);
        drop((partials, values));
        staging.give(pinned);
        finished
    }))
}

/// The statistics of the first `n` values of `x`, taken on the host's cores from a copy queued
/// now behind the forward's work: a stage too small for the kernels' launches to pay for
/// themselves, recorded without the wait for the GPU a fetch would be.
pub(super) fn stage_stats_on_host<D: Dtype, V: Send + 'static>(
    on: StatsOn,
    x: &CudaSlice<D>,
    n: usize,
    values: V,
) -> Result<StatsLater> {
    let later = copy_later(on, x, n, values, Queue::Beside)?;
    Ok(Box::new(move || Ok(TensorStats::of(&later()?))))
}

/// The first `n` values of `x` as host f32, copied into page-locked memory on the forward's
/// stream or on the side stream behind everything queued on the forward's so far (`queue`),
/// waited for and widened when called; `values` (what holds `x`) is kept until then.
pub(super) fn copy_later<D: Dtype, V: Send + 'static>(
    on: StatsOn,
    x: &CudaSlice<D>,
    n: usize,
    values: V,
    queue: Queue,
) -> Result<FetchLater> {
    let stream = match queue {
        Queue::Forward => {
            on.gpu.stream.context().bind_to_thread()?;
            on.gpu.stream.clone()
        }
        Queue::Beside => {
            on.behind_the_forward()?;
            on.side.clone()
        }
    };
    let StatsOn { gpu, staging, .. } = on;
    let n = n.min(x.len());
    let bytes = n * size_of::<D>();
    let mut pinned = staging.take(bytes);
    if n > 0 {
        let host: &mut [D] = bytemuck::cast_slice_mut(pinned.bytes(&gpu, bytes)?);
        copy_back(&stream, &x.slice(..n), host)?;
    }
    let landing = Landing::new(stream, (pinned, values))?;
    Ok(Box::new(move || {
        // Called on any thread: the wait binds the GPU's context there.
        let (pinned, values) = landing.wait()?;
        drop(values);
        let widened = if n == 0 {
            Vec::new()
        } else {
            let host: &[D] = bytemuck::cast_slice(pinned.landed(bytes)?);
            host.iter().map(|&v| v.to_f32()).collect()
        };
        staging.give(pinned);
        Ok(widened)
    }))
}

/// What work queued on a stream uses (the page-locked memory it copies into, the device
/// buffers it reads or writes), held until that work has landed: when the closure that waits
/// for it runs, and also where that closure is dropped uncalled (a writer that stopped), so
/// that no buffer goes back to the free list, nor page-locked memory to the host, under a
/// kernel or a copy.
struct Landing<T> {
    stream: Arc<CudaStream>,
    landed: CudaEvent,
    held: Option<T>,
}

impl<T> Landing<T> {
    /// `held` until the work queued on `stream` so far has landed.
    fn new(stream: Arc<CudaStream>, held: T) -> Result<Self> {
        let landed = stream.record_event(None)?;
        Ok(Landing {
            stream,
            landed,
            held: Some(held),
        })
    }

    /// What it holds, once the work has landed.
    fn wait(mut self) -> Result<T> {
        self.stream.context().bind_to_thread()?;
        self.landed.synchronize()?;
        Ok(self.held.take().expect("held until waited for"))
    }
}

impl<T> Drop for Landing<T> {
    fn drop(&mut self) {
        if self.held.is_some() && self.stream.context().bind_to_thread().is_ok() {
            // Nothing to report to: the owner is gone, and a wait fails only on a lost device.
            let _ = self.landed.synchronize();
        }
    }
}

/// The statistics from the partials landed in `pinned` (laid out as `layout` says).
fn finish(pinned: &Pinned, layout: &Layout, n: usize) -> Result<TensorStats> {
    let host: &[u64] = bytemuck::cast_slice(pinned.landed(layout.total() * 8)?);
    let counts = layout.part(host, Layout::COUNTS);
    let hash_lanes = layout.part(host, Layout::HASH_LANES);
    let sums: &[f64] = bytemuck::cast_slice(layout.part(host, Layout::SUMS));
    let deviations: &[f64] = bytemuck::cast_slice(layout.part(host, Layout::DEVIATIONS));
    let device_mean = f64::from_bits(layout.part(host, Layout::MEAN)[0]);
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
    let chunk_sketches: &[f64] = bytemuck::cast_slice(layout.part(host, Layout::SKETCH));
    Ok(TensorStats {
        hash: content_hash_of_pieces(&piece_hashes, bytes),
        sketch: merge_sketches(chunk_sketches.chunks_exact(SKETCH_BUCKETS)),
        ..stats
    })
}

/// `src` copied into `host` on `stream`, not waited for.
fn copy_back<T: DeviceRepr>(
    stream: &CudaStream,
    src: &impl DevicePtr<T>,
    host: &mut [T],
) -> Result<()> {
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
