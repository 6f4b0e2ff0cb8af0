//! One rank's GPU: opening it with its cuBLAS handle, memory meter and resident blocks; values to
//! and from it; a stored weight dequantized on it.

use std::cell::RefCell;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Context, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};

use rayon::prelude::*;

use super::dtype::Dtype;
use super::memory::{Buffer, FreeList, Meter, Pinned, Staging};
use super::resident::Resident;
use super::stats::{copy_later, stage_stats, stage_stats_on_host, StatsOn};
use super::Gpu;
use crate::exec::mat::{FetchLater, Mat, Queue, Remote};
use crate::exec::passes::Passes;
use crate::exec::storage::stored::StoredBlock;
use crate::trace::stats::StatsLater;
use crate::weights::GgmlType;

/// Values per parallel task of the host's conversions to and from a dtype.
const CONVERT_CHUNK: usize = 1 << 15;

/// Uploads of at most this many bytes (row indices, masks, GEMM addresses, norm weights) are
/// copied from the host's own memory without waiting for the GPU: the driver stages them before
/// the call returns. Through the page-locked buffer, every upload waited for all the work queued
/// before it, so the host could never run ahead of the GPU.
const SMALL_UPLOAD: usize = 64 << 10;

/// An op's output left on its GPU (a [`Mat`]'s twin, which holds the same values as the host's:
/// these are fetched from it, and any change to them drops it). The next op on that GPU reads it
/// instead of converting and uploading the host's values again; where one GPU runs the forward,
/// the host fetches the values only when it reads them, and a recorded stage's statistics are
/// taken here ([`super::stats`]).
pub(super) struct DeviceTwin<D: DeviceRepr> {
    gpu: Gpu,
    buf: Buffer<D>,
    len: usize,
    staging: Arc<Staging>,
    /// The stream its statistics are taken on, beside the forward's.
    side: Arc<CudaStream>,
}

impl<D: Dtype> Remote for DeviceTwin<D> {
    fn fetch(&self) -> Result<Vec<f32>> {
        self.gpu.stream.context().bind_to_thread()?;
        let mut pinned = self.staging.take(self.len * size_of::<D>());
        let values = download_through(&self.gpu, &mut pinned, &self.buf, self.len);
        self.staging.give(pinned);
        values
    }

    fn stats(self: Arc<Self>) -> Result<Option<StatsLater>> {
        let (on, len) = (self.stats_on(), self.len);
        let buf = &self.buf.slice;
        if len < STATS_ON_GPU_FROM {
            return stage_stats_on_host(on, buf, len, self.clone()).map(Some);
        }
        stage_stats(on, buf, len, self.clone()).map(Some)
    }

    fn fetch_later(self: Arc<Self>, queue: Queue) -> Result<Option<FetchLater>> {
        copy_later(
            self.stats_on(),
            &self.buf.slice,
            self.len,
            self.clone(),
            queue,
        )
        .map(Some)
    }
}

impl<D: Dtype> DeviceTwin<D> {
    /// Where work on the values beside the forward runs: the side stream, behind the forward.
    fn stats_on(&self) -> StatsOn {
        StatsOn {
            gpu: self.gpu.clone(),
            side: self.side.clone(),
            staging: self.staging.clone(),
            free: self.buf.free.clone(),
            meter: self.buf.meter.clone(),
        }
    }
}

/// Values from which a recorded stage's statistics are taken on the GPU: below, copying the
/// values back and taking them on the host's cores costs less than the kernels' launches and the
/// partials' trip (a stage at 8 tokens is tens of thousands of values).
const STATS_ON_GPU_FROM: usize = 1 << 20;

/// An op's input on its GPU: a matrix's twin, or its values uploaded.
pub(super) enum Input<'a, D: DeviceRepr> {
    Twin(&'a Buffer<D>),
    Uploaded(Buffer<D>),
}

impl<D: DeviceRepr> Deref for Input<'_, D> {
    type Target = Buffer<D>;

    fn deref(&self) -> &Buffer<D> {
        match self {
            Input::Twin(b) => b,
            Input::Uploaded(b) => b,
        }
    }
}

/// One rank's GPU: its kernels, its cuBLAS handle, its memory meter, its resident blocks, and
/// the page-locked buffer every copy to and from it goes through.
pub(super) struct Device {
    pub(super) gpu: Gpu,
    pub(super) blas: CudaBlas,
    pub(super) meter: Arc<Meter>,
    /// Memory its buffers freed, for the next buffers of their sizes.
    free: Arc<FreeList>,
    pub(super) resident: Resident,
    pinned: RefCell<Pinned>,
    /// Whether an op's output stays on the GPU alone until the host reads it: where this GPU is
    /// the run's only one, so that no op holding another GPU's lock ever waits on a fetch.
    pub(super) lazy_outputs: bool,
    staging: Arc<Staging>,
    /// The stream recorded stages' statistics run on, so that the forward's own waits for the
    /// GPU never include them (the forward's stream where outputs are fetched at once).
    side: Arc<CudaStream>,
}

// SAFETY: a Device is only used under its mutex, by one thread at a time; its context is bound
// to that thread before each use.
unsafe impl Send for Device {}

impl Device {
    pub(super) fn bind(&self) -> Result<()> {
        self.gpu.stream.context().bind_to_thread()?;
        Ok(())
    }

    /// A zeroed buffer for `n` values.
    pub(super) fn alloc<D: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<Buffer<D>> {
        let mut buf = self.alloc_written::<D>(n)?;
        self.gpu
            .stream
            .memset_zeros(&mut *buf.slice)
            .with_context(|| format!("zeroing {n} values on {}", self.gpu.name))?;
        Ok(buf)
    }

    /// A buffer for `n` values that the op allocating it writes in full before anything reads
    /// it (a copy from the host, a dequantization, a GEMM's output): not zeroed first, which
    /// for a routed expert's three weights was a memset of its whole dequantized size; memory
    /// freed earlier of its size where the GPU kept some ([`FreeList`]).
    pub(super) fn alloc_written<D: DeviceRepr>(&self, n: usize) -> Result<Buffer<D>> {
        self.free
            .buffer(&self.meter, n.max(1))
            .with_context(|| format!("allocating {n} values on {}", self.gpu.name))
    }

    /// `x` as dtype `D` on this GPU for an op that only reads it: the output of the op before
    /// it where that was left here ([`DeviceTwin`]), else uploaded.
    pub(super) fn input<'a, D: Dtype>(&self, x: &'a Mat<f32>) -> Result<Input<'a, D>> {
        match self.twin_here::<D>(x) {
            Some(buf) => Ok(Input::Twin(buf)),
            None => Ok(Input::Uploaded(self.upload(x.fetched()?)?)),
        }
    }

    /// A cache tensor's passes as one input on this GPU: a single pass (a prompt's) read where
    /// its op left it; several copied one after another on the GPU where it holds them all (a
    /// prompt and the positions generated after it), else uploaded.
    pub(super) fn passes_input<'a, D: Dtype>(
        &self,
        passes: Passes<'a, f32>,
    ) -> Result<Input<'a, D>> {
        let several = match passes.0 {
            [only] => return self.input::<D>(only),
            several => several,
        };
        let held: Option<Vec<&Buffer<D>>> =
            several.iter().map(|m| self.twin_here::<D>(m)).collect();
        let Some(held) = held else {
            let rows = several
                .iter()
                .map(|m| m.fetched())
                .collect::<Result<Vec<_>>>()?;
            return Ok(Input::Uploaded(self.upload_parts(&rows)?));
        };
        let mut buf = self.alloc_written::<D>(several.iter().map(Mat::len).sum())?;
        let mut at = 0;
        for (m, src) in several.iter().zip(held) {
            let len = m.len();
            if len > 0 {
                let mut to = buf.slice.slice_mut(at..at + len);
                self.gpu
                    .stream
                    .memcpy_dtod(&src.slice.slice(..len), &mut to)?;
            }
            at += len;
        }
        Ok(Input::Uploaded(buf))
    }

    /// `x`'s twin, where it is a buffer of dtype `D` on this GPU holding all its values.
    pub(super) fn twin_here<'a, D: Dtype>(&self, x: &'a Mat<f32>) -> Option<&'a Buffer<D>> {
        x.twin::<DeviceTwin<D>>()
            .filter(|t| Arc::ptr_eq(&t.gpu.stream, &self.gpu.stream) && t.len >= x.len())
            .map(|t| &t.buf)
    }

    /// `m` with its values uploaded as `D` beside them, unless they are here already.
    pub(super) fn placed<D: Dtype>(&self, m: Mat<f32>) -> Result<Mat<f32>> {
        if m.is_empty() || self.twin_here::<D>(&m).is_some() {
            return Ok(m);
        }
        let twin = self.twin(self.upload::<D>(m.fetched()?)?, m.len());
        Ok(m.with_twin(twin))
    }

    /// `buf`'s first `rows × cols` values as a host matrix with `buf` left beside it as its
    /// twin, for the next op here to read; the host's copy fetched now, or where this GPU runs
    /// alone when the host first reads it.
    pub(super) fn output<D: Dtype>(
        &self,
        rows: usize,
        cols: usize,
        buf: Buffer<D>,
    ) -> Result<Mat<f32>> {
        let twin = self.twin(buf, rows * cols);
        if self.lazy_outputs {
            return Ok(Mat::remote(rows, cols, twin));
        }
        let values = self.download(&twin.buf, rows * cols)?;
        Ok(Mat::new(rows, cols, values).with_twin(twin))
    }

    /// `buf`, holding `len` values, as a matrix's twin on this GPU.
    fn twin<D: Dtype>(&self, buf: Buffer<D>, len: usize) -> DeviceTwin<D> {
        DeviceTwin {
            gpu: self.gpu.clone(),
            buf,
            len,
            staging: self.staging.clone(),
            side: self.side.clone(),
        }
    }

    /// Host f32 values as dtype `D` on this GPU, converted on the host's cores straight into
    /// page-locked memory (an activation is tens of millions of values at GLM-5's widths and 512
    /// tokens) and copied from there.
    pub(super) fn upload<D: Dtype>(&self, values: &[f32]) -> Result<Buffer<D>> {
        self.upload_parts(&[values])
    }

    /// [`Self::upload`] of the parts one after another in one buffer: one copy for many
    /// inputs (the rows of every routed expert of a group).
    pub(super) fn upload_parts<D: Dtype>(&self, parts: &[&[f32]]) -> Result<Buffer<D>> {
        let n = parts.iter().map(|p| p.len()).sum();
        let mut buf = self.alloc_written::<D>(n)?;
        if n == 0 {
            return Ok(buf);
        }
        if n * size_of::<D>() <= SMALL_UPLOAD {
            let host: Vec<D> = parts
                .iter()
                .flat_map(|p| p.iter().map(|&v| D::from_f32(v)))
                .collect();
            self.copy_up_unwaited(&host, &mut buf)?;
            return Ok(buf);
        }
        let mut pinned = self.pinned.borrow_mut();
        let host: &mut [D] = bytemuck::cast_slice_mut(pinned.bytes(&self.gpu, n * size_of::<D>())?);
        // Each part's place in the buffer; parts and their chunks converted in parallel (a
        // group of routed experts is many parts of a few rows each).
        let mut places = Vec::with_capacity(parts.len());
        let mut rest = &mut host[..];
        for values in parts {
            let (place, tail) = rest.split_at_mut(values.len());
            places.push(place);
            rest = tail;
        }
        places
            .into_par_iter()
            .zip(parts)
            .for_each(|(place, values)| {
                place
                    .par_chunks_mut(CONVERT_CHUNK)
                    .zip(values.par_chunks(CONVERT_CHUNK))
                    .for_each(|(to, from)| {
                        to.iter_mut()
                            .zip(from.iter())
                            .for_each(|(t, &v)| *t = D::from_f32(v))
                    })
            });
        self.copy_up(host, &mut buf)?;
        Ok(buf)
    }

    /// Values sent as they are, through the page-locked buffer.
    pub(super) fn upload_exact<T: DeviceRepr + bytemuck::Pod>(
        &self,
        values: &[T],
    ) -> Result<Buffer<T>> {
        let mut buf = self.alloc_written::<T>(values.len())?;
        if size_of_val(values) <= SMALL_UPLOAD {
            self.copy_up_unwaited(values, &mut buf)?;
        } else {
            let mut pinned = self.pinned.borrow_mut();
            let host = pinned.bytes(&self.gpu, size_of_val(values))?;
            host.copy_from_slice(bytemuck::cast_slice(values));
            self.copy_up(bytemuck::cast_slice::<u8, T>(host), &mut buf)?;
        }
        Ok(buf)
    }

    /// `host` (the host's own memory, a [`SMALL_UPLOAD`] at most) into the start of `buf`,
    /// queued behind the stream's work without waiting for it.
    fn copy_up_unwaited<T: DeviceRepr>(&self, host: &[T], buf: &mut Buffer<T>) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        let stream = &self.gpu.stream;
        stream.context().bind_to_thread()?;
        let (dst, _record) = buf.slice.device_ptr_mut(stream);
        // SAFETY: `buf` holds at least `host.len()` values (callers size it so); `host` is
        // pageable memory, which the driver copies into its own staging memory before the call
        // returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, host, stream.cu_stream()) }?;
        Ok(())
    }

    /// `host` into the start of `buf`, waited for (so that the page-locked buffer may be
    /// written again).
    fn copy_up<T: DeviceRepr>(&self, host: &[T], buf: &mut Buffer<T>) -> Result<()> {
        let stream = &self.gpu.stream;
        stream.context().bind_to_thread()?;
        let (dst, _record) = buf.slice.device_ptr_mut(stream);
        // SAFETY: `buf` holds at least `host.len()` values (callers size it so); the copy is
        // waited for before `host` can change.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, host, stream.cu_stream()) }?;
        stream.synchronize()?;
        Ok(())
    }

    /// A weight's host f32 values as dtype `D` on this GPU: sent as f32 and rounded there by the
    /// F32 dequantization kernel (bit for bit the host's rounding to nearest even), so that a
    /// weight made on the host (llama.cpp's split kv_b assembled, a planted fault) is not
    /// rounded value by value on one host core on its way up.
    pub(super) fn upload_weight<D: Dtype>(&self, values: &[f32]) -> Result<Buffer<D>> {
        let n = values.len();
        let mut out = self.alloc_written::<D>(n)?;
        if n == 0 {
            return Ok(out);
        }
        let raw = self.upload_exact(bytemuck::cast_slice::<f32, u8>(values))?;
        self.gpu
            .launch_dequant(GgmlType::F32, &raw.slice, &mut *out.slice, n)?;
        Ok(out)
    }

    /// The first `n` values of `buf` as host f32: copied into page-locked memory, then widened
    /// on the host's cores.
    pub(super) fn download<D: Dtype>(&self, buf: &Buffer<D>, n: usize) -> Result<Vec<f32>> {
        download_through(&self.gpu, &mut self.pinned.borrow_mut(), buf, n)
    }

    /// A stored block of a weight dequantized on this GPU to dtype `D`: from its blocks kept
    /// here, or read from the file and uploaded first (and kept, within the budget).
    pub(super) fn dequantize_stored<D: Dtype>(&mut self, w: &StoredBlock<'_>) -> Result<Buffer<D>> {
        let (rows, cols) = w.shape();
        let n = rows * cols;
        let mut out = self.alloc_written::<D>(n)?;
        if n == 0 {
            return Ok(out);
        }
        let key = w.key();
        if let Some(blocks) = self.resident.blocks.get(&key) {
            self.gpu
                .launch_dequant(w.ty(), &blocks.slice, &mut *out.slice, n)?;
            return Ok(out);
        }
        let began = std::time::Instant::now();
        let bytes = w.nbytes();
        let mut blocks = self.alloc_written::<u8>(bytes)?;
        {
            let mut pinned = self.pinned.borrow_mut();
            let staging = pinned.bytes(&self.gpu, bytes)?;
            w.read_into(staging)?;
            self.copy_up(staging, &mut blocks)?;
        }
        self.gpu
            .launch_dequant(w.ty(), &blocks.slice, &mut *out.slice, n)?;
        let r = &mut self.resident;
        r.loaded += bytes as u64;
        r.load_seconds += began.elapsed().as_secs_f64();
        if r.room_for_blocks(bytes as u64) {
            r.kept += bytes as u64;
            r.blocks.insert(key, blocks);
        }
        Ok(out)
    }
}

/// The first `n` values of `buf` as host f32: copied into `pinned`, then widened on the host's
/// cores.
fn download_through<D: Dtype>(
    gpu: &Gpu,
    pinned: &mut Pinned,
    buf: &Buffer<D>,
    n: usize,
) -> Result<Vec<f32>> {
    let n = n.min(buf.slice.len());
    if n == 0 {
        return Ok(Vec::new());
    }
    let host: &mut [D] = bytemuck::cast_slice_mut(pinned.bytes(gpu, n * size_of::<D>())?);
    let stream = &gpu.stream;
    stream.context().bind_to_thread()?;
    {
        let (src, _record) = buf.slice.device_ptr(stream);
        // SAFETY: `buf` holds at least `n` values; the copy is waited for before `host` is read.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(host, src, stream.cu_stream()) }?;
    }
    stream.synchronize()?;
    Ok(host
        .par_iter()
        .with_min_len(CONVERT_CHUNK)
        .map(|&v| v.to_f32())
        .collect())
}

/// GPU `ordinal` as a rank's device, its resident budget taken from its free memory now.
pub(super) fn open_device(ordinal: usize, lazy_outputs: bool) -> Result<Mutex<Device>> {
    let gpu = Gpu::open(ordinal)?;
    let blas =
        CudaBlas::new(gpu.stream.clone()).map_err(|e| anyhow!("cuBLAS on {}: {e:?}", gpu.name))?;
    gpu.stream.context().bind_to_thread()?;
    let (free, total) = cudarc::driver::result::mem_get_info()
        .map_err(|e| anyhow!("free memory of {}: {e:?}", gpu.name))?;
    let side = if lazy_outputs {
        // The statistics' stream orders itself behind the forward's with events of its own
        // (`stats::stage_stats`) and keeps the values it reads alive until it is done: cudarc's
        // tracking of every buffer's uses across streams would only add an event per use.
        // SAFETY: no buffer is shared between the streams but through those events.
        unsafe { gpu.stream.context().disable_event_tracking() };
        gpu.stream.context().new_stream()?
    } else {
        gpu.stream.clone()
    };
    let freed = Arc::new(FreeList::new(gpu.stream.clone()));
    Ok(Mutex::new(Device {
        gpu,
        blas,
        meter: Arc::default(),
        free: freed,
        resident: Resident::new(free as u64, total as u64),
        pinned: RefCell::default(),
        lazy_outputs,
        staging: Arc::default(),
        side,
    }))
}
