//! The CUDA backend: the ops of [`Backend`] on NVIDIA GPUs, one GPU per tensor-parallel rank.
//! Each rank keeps its shards' stored GGML blocks on its GPU after their first use and
//! dequantizes a weight there into the run's dtype (f32, bf16 or f16) for the op that multiplies
//! by it, freeing that copy after; GEMMs go through cuBLAS with f32 accumulation, norms and element-wise ops through `kernels/ops.cu`, and the
//! all-reduce of a TP run through NCCL across the ranks' GPUs. Activations travel as host
//! matrices between ops (they are a few rows at most), so the same forward and shard plan drive
//! the CPU and the GPUs, and each op can be checked against the CPU's (`glmcheck selftest`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg,
    ValidAsZeroBits,
};
use cudarc::nccl::{Comm, NcclType, ReduceOp};
use half::{bf16, f16};

use super::{DequantOutput, Gpu};
use crate::dtype::Precision;
use crate::exec::attention_core::AttentionInputs;
use crate::exec::backend::{all_computed, sum_in_rank_order, Backend};
use crate::exec::mat::Mat;
use crate::exec::rope::{Rope, RotateSpec};
use crate::exec::stored::{BlockKey, StoredBlock};

/// Threads per block of the row kernels (`ROW_THREADS` in `kernels/ops.cu`).
const ROW_THREADS: u32 = 256;
/// Shared memory one attention block may use for its scores (the default limit per block).
const MAX_SCORES_BYTES: u32 = 40 << 10;
/// Threads per block of the element-wise kernels.
const ELEMENT_THREADS: u32 = 256;

/// A dtype the GPU holds activations and weights in (its kernels' suffix and widening come
/// from [`DequantOutput`]).
trait Dtype: DequantOutput + NcclType + Unpin + Send + Sync + 'static {
    const CUDA: cudaDataType;
    /// `v` rounded to nearest even (exact for values the dtype holds).
    fn from_f32(v: f32) -> Self;
    /// A weight buffer of this dtype.
    fn held(buf: Buffer<Self>) -> Held;
}

impl Dtype for f32 {
    const CUDA: cudaDataType = cudaDataType::CUDA_R_32F;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn held(buf: Buffer<Self>) -> Held {
        Held::F32(buf)
    }
}

impl Dtype for bf16 {
    const CUDA: cudaDataType = cudaDataType::CUDA_R_16BF;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn held(buf: Buffer<Self>) -> Held {
        Held::Bf16(buf)
    }
}

impl Dtype for f16 {
    const CUDA: cudaDataType = cudaDataType::CUDA_R_16F;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn held(buf: Buffer<Self>) -> Held {
        Held::F16(buf)
    }
}

/// `$body` with the type `$D` standing for the dtype of precision `$p`.
macro_rules! with_dtype {
    ($p:expr, $D:ident => $body:expr) => {
        match $p {
            Precision::Bf16 => {
                type $D = bf16;
                $body
            }
            Precision::F16 => {
                type $D = f16;
                $body
            }
            Precision::F32 | Precision::F64 => {
                type $D = f32;
                $body
            }
        }
    };
}

/// Bytes glmcheck holds on one GPU now and at most so far.
#[derive(Default)]
struct Meter {
    now: AtomicU64,
    peak: AtomicU64,
}

impl Meter {
    fn take(&self, bytes: u64) {
        let now = self.now.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn give(&self, bytes: u64) {
        self.now.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// Stored weight blocks kept on one GPU after their first use, up to a budget: a rank's shards
/// stay on its GPU as the file stores them (a quarter of bf16's bytes at Q4_K), and each use
/// only dequantizes them there. Blocks past the budget are uploaded for one use and freed.
struct Resident {
    /// Page-locked host memory blocks pass through on their way up: the DMA engine copies it
    /// at the link's speed, where pageable memory goes through the driver's own staging.
    staging: Option<PinnedHostSlice<u8>>,
    blocks: HashMap<BlockKey, Buffer<u8>>,
    /// Bytes of blocks it may keep: the GPU's free memory at start, less a reserve for the
    /// dequantized weights and activations of the op running.
    budget: u64,
    kept: u64,
    /// Bytes read from the files and uploaded, and the seconds that took.
    loaded: u64,
    load_seconds: f64,
}

/// GPU memory left free for the working set of one op (dequantized weights, activations):
/// a tenth of the GPU, at least 4 GiB.
fn working_reserve(total: u64) -> u64 {
    (total / 10).max(4 << 30)
}

impl Resident {
    fn new(free: u64, total: u64) -> Self {
        Resident {
            staging: None,
            blocks: HashMap::new(),
            budget: free.saturating_sub(working_reserve(total)),
            kept: 0,
            loaded: 0,
            load_seconds: 0.0,
        }
    }
}

impl Resident {
    /// The staging buffer, grown to at least `bytes` (to the next power of two, so that a run
    /// allocates it a few times at most).
    fn staging(&mut self, gpu: &Gpu, bytes: usize) -> Result<&mut [u8]> {
        if self.staging.as_ref().is_none_or(|s| s.len() < bytes) {
            self.staging = None;
            let ctx = gpu.stream.context();
            // SAFETY: every byte the caller reads is written first (`read_into` fills it).
            let pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes.next_power_of_two(), 0) }
                .with_context(|| format!("{} bytes of page-locked memory", bytes))?;
            self.staging = Some(pinned);
        }
        let staging = self.staging.as_mut().expect("allocated above");
        Ok(staging.as_mut_slice()?)
    }
}

/// One rank's use of its GPU in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankMemory {
    /// The most bytes glmcheck held on the GPU at once.
    pub peak_bytes: u64,
    /// Bytes of stored weight blocks kept on the GPU.
    pub resident_bytes: u64,
    /// Bytes of stored blocks read from the model files and uploaded, and the seconds taken.
    pub loaded_bytes: u64,
    pub load_seconds: f64,
}

/// A device buffer counted on its GPU's meter while it lives.
struct Buffer<D: DeviceRepr> {
    slice: CudaSlice<D>,
    meter: Arc<Meter>,
}

impl<D: DeviceRepr> Drop for Buffer<D> {
    fn drop(&mut self) {
        self.meter
            .give((self.slice.len() * std::mem::size_of::<D>()) as u64);
    }
}

/// One rank's GPU: its kernels, its cuBLAS handle, its memory meter, its resident blocks.
struct Device {
    gpu: Gpu,
    blas: CudaBlas,
    meter: Arc<Meter>,
    resident: Resident,
}

// SAFETY: a Device is only used under its mutex, by one thread at a time; its context is bound
// to that thread before each use.
unsafe impl Send for Device {}

impl Device {
    fn bind(&self) -> Result<()> {
        self.gpu.stream.context().bind_to_thread()?;
        Ok(())
    }

    fn alloc<D: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<Buffer<D>> {
        let slice = self
            .gpu
            .stream
            .alloc_zeros::<D>(n.max(1))
            .with_context(|| format!("allocating {n} values on {}", self.gpu.name))?;
        self.meter
            .take((slice.len() * std::mem::size_of::<D>()) as u64);
        Ok(Buffer {
            slice,
            meter: self.meter.clone(),
        })
    }

    /// Host f32 values as dtype `D` on this GPU.
    fn upload<D: Dtype>(&self, values: &[f32]) -> Result<Buffer<D>> {
        let mut buf = self.alloc::<D>(values.len())?;
        if !values.is_empty() {
            let host: Vec<D> = values.iter().map(|&v| D::from_f32(v)).collect();
            self.gpu.stream.memcpy_htod(&host, &mut buf.slice)?;
        }
        Ok(buf)
    }

    /// The first `n` values of `buf` as host f32.
    fn download<D: Dtype>(&self, buf: &Buffer<D>, n: usize) -> Result<Vec<f32>> {
        let host = self.gpu.stream.clone_dtoh(&buf.slice)?;
        Ok(host.into_iter().take(n).map(D::to_f32).collect())
    }

    /// A stored block of a weight dequantized on this GPU to dtype `D`: from its blocks kept
    /// here, or read from the file and uploaded first (and kept, within the budget).
    fn dequantize_stored<D: Dtype>(&mut self, w: &StoredBlock<'_>) -> Result<Buffer<D>> {
        let (rows, cols) = w.shape();
        let n = rows * cols;
        let mut out = self.alloc::<D>(n)?;
        if n == 0 {
            return Ok(out);
        }
        let key = w.key();
        if let Some(blocks) = self.resident.blocks.get(&key) {
            self.gpu
                .launch_dequant(w.ty(), &blocks.slice, &mut out.slice, n)?;
            return Ok(out);
        }
        let began = std::time::Instant::now();
        let bytes = w.nbytes();
        let mut blocks = self.alloc::<u8>(bytes)?;
        {
            let staging = self.resident.staging(&self.gpu, bytes)?;
            w.read_into(&mut staging[..bytes])?;
            let stream = &self.gpu.stream;
            stream.context().bind_to_thread()?;
            let (dst, _record) = blocks.slice.device_ptr_mut(stream);
            // SAFETY: `dst` holds `bytes` bytes (n > 0 values need some); the copy is waited
            // for before the staging buffer is written again.
            unsafe {
                let to = stream.cu_stream();
                cudarc::driver::result::memcpy_htod_async(dst, &staging[..bytes], to)
            }?;
            stream.synchronize()?;
        }
        self.gpu
            .launch_dequant(w.ty(), &blocks.slice, &mut out.slice, n)?;
        let r = &mut self.resident;
        r.loaded += bytes as u64;
        r.load_seconds += began.elapsed().as_secs_f64();
        if r.kept + bytes as u64 <= r.budget {
            r.kept += bytes as u64;
            r.blocks.insert(key, blocks);
        }
        Ok(out)
    }

    fn kernel(&self, op: &str, suffix: &str) -> Result<cudarc::driver::CudaFunction> {
        self.gpu.ops_kernel(&format!("{op}_{suffix}"))
    }

    /// RMSNorm (no bias) or LayerNorm (`bias` Some) of every row of `x`.
    fn norm<D: Dtype>(
        &self,
        x: &Mat<f32>,
        w: &[f32],
        bias: Option<&[f32]>,
        eps: f64,
    ) -> Result<Mat<f32>> {
        check_len("norm weight", w.len(), x.cols)?;
        if let Some(b) = bias {
            check_len("norm bias", b.len(), x.cols)?;
        }
        let (input, weight) = (self.upload::<D>(&x.data)?, self.upload::<D>(w)?);
        let mut out = self.alloc::<D>(x.data.len())?;
        let (cols, eps) = (to_u32(x.cols)?, eps as f32);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(x.rows)?, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        if x.rows == 0 {
            return Ok(x.clone());
        }
        match bias {
            None => {
                let f = self.kernel("rms_norm", D::SUFFIX)?;
                let mut launch = self.gpu.stream.launch_builder(&f);
                launch
                    .arg(&input.slice)
                    .arg(&weight.slice)
                    .arg(&mut out.slice)
                    .arg(&cols)
                    .arg(&eps);
                // SAFETY: rows × cols values in and out, cols weights, as allocated above.
                unsafe { launch.launch(cfg) }?;
            }
            Some(b) => {
                let bias = self.upload::<D>(b)?;
                let f = self.kernel("layer_norm", D::SUFFIX)?;
                let mut launch = self.gpu.stream.launch_builder(&f);
                launch
                    .arg(&input.slice)
                    .arg(&weight.slice)
                    .arg(&bias.slice)
                    .arg(&mut out.slice)
                    .arg(&cols)
                    .arg(&eps);
                // SAFETY: as above, with cols bias values.
                unsafe { launch.launch(cfg) }?;
            }
        }
        Ok(Mat::new(x.rows, x.cols, self.download(&out, x.data.len())?))
    }

    /// An element-wise op of two equally shaped matrices (`silu_mul`, `add`).
    fn elementwise<D: Dtype>(&self, op: &str, a: &Mat<f32>, b: &Mat<f32>) -> Result<Mat<f32>> {
        if (a.rows, a.cols) != (b.rows, b.cols) {
            bail!(
                "{op}: {}×{} and {}×{} differ",
                a.rows,
                a.cols,
                b.rows,
                b.cols
            );
        }
        let n = a.data.len();
        if n == 0 {
            return Ok(a.clone());
        }
        let (x, y) = (self.upload::<D>(&a.data)?, self.upload::<D>(&b.data)?);
        let mut out = self.alloc::<D>(n)?;
        let count = to_u32(n)?;
        let f = self.kernel(op, D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&x.slice)
            .arg(&y.slice)
            .arg(&mut out.slice)
            .arg(&count);
        // SAFETY: n values in each input and the output.
        unsafe { launch.launch(elements(count)) }?;
        Ok(Mat::new(a.rows, a.cols, self.download(&out, n)?))
    }

    /// f32 values rounded to the dtype by the GPU.
    fn round<D: Dtype>(&self, xs: &mut [f32]) -> Result<()> {
        if xs.is_empty() {
            return Ok(());
        }
        let input = self.upload::<f32>(xs)?;
        let mut out = self.alloc::<D>(xs.len())?;
        let count = to_u32(xs.len())?;
        let f = self.kernel("round_to", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch.arg(&input.slice).arg(&mut out.slice).arg(&count);
        // SAFETY: n values in and out.
        unsafe { launch.launch(elements(count)) }?;
        xs.copy_from_slice(&self.download(&out, xs.len())?);
        Ok(())
    }

    /// RoPE on `m`'s rows in place (f32 in and out, as the caller rounds).
    fn rope(&self, m: &mut Mat<f32>, rope: &Rope<f32>, spec: RotateSpec) -> Result<()> {
        let half = rope.inv_freq().len();
        if spec.width == 0 || m.cols % spec.width != 0 || spec.offset + 2 * half > spec.width {
            bail!(
                "rope: rows of {} values do not hold heads of {} with {} rope dims from {}",
                m.cols,
                spec.width,
                2 * half,
                spec.offset
            );
        }
        let heads = m.cols / spec.width;
        let n = m.rows * heads * half;
        if n == 0 {
            return Ok(());
        }
        let mut x = self.upload::<f32>(&m.data)?;
        let freq = self.upload::<f32>(rope.inv_freq())?;
        let f = self.kernel("rope", "f32")?;
        let (rows, width, heads32) = (to_u32(m.rows)?, to_u32(spec.width)?, to_u32(heads)?);
        let (offset, half32, start) = (to_u32(spec.offset)?, to_u32(half)?, to_u32(spec.start)?);
        let (interleaved, scale) = (u32::from(spec.interleaved), rope.scale());
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&mut x.slice)
            .arg(&freq.slice)
            .arg(&rows)
            .arg(&width)
            .arg(&heads32)
            .arg(&offset)
            .arg(&half32)
            .arg(&start)
            .arg(&interleaved)
            .arg(&scale);
        // SAFETY: rows × heads × width values, `half` frequencies, each thread's pair inside its
        // head (checked above).
        unsafe { launch.launch(elements(to_u32(n)?)) }?;
        m.data = self.download(&x, m.data.len())?;
        Ok(())
    }

    /// MLA attention (see [`AttentionInputs`]), one block per position and head, the context
    /// in f32.
    fn attention<D: Dtype>(&self, a: &AttentionInputs<'_, f32>) -> Result<Vec<f32>> {
        let (t, heads) = (a.q.rows, a.heads);
        let n = t * heads * a.v;
        if n == 0 {
            return Ok(Vec::new());
        }
        let slots = a.keys.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut keys = vec![-1i32; t * slots];
        for (row, chosen) in keys.chunks_mut(slots).zip(a.keys) {
            for (k, &j) in row.iter_mut().zip(chosen) {
                if j >= 0 && j as usize >= a.positions {
                    bail!(
                        "attention: key {j} beyond the {} cached positions",
                        a.positions
                    );
                }
                *k = j;
            }
        }
        let shared = (slots * std::mem::size_of::<f32>()) as u32;
        if shared > MAX_SCORES_BYTES {
            bail!(
                "attention over {slots} keys: at most {} in one block",
                MAX_SCORES_BYTES / 4
            );
        }
        let q = self.upload::<D>(&a.q.data)?;
        let kv = self.upload::<D>(a.kv)?;
        let k_rope = self.upload::<D>(a.k_rope)?;
        let mut key_buf = self.gpu.stream.alloc_zeros::<i32>(keys.len())?;
        self.gpu.stream.memcpy_htod(&keys, &mut key_buf)?;
        let mut out = self.alloc::<f32>(n)?;
        let (heads32, nope, rope) = (to_u32(heads)?, to_u32(a.nope)?, to_u32(a.rope)?);
        let (v, slots32) = (to_u32(a.v)?, to_u32(slots)?);
        let scale = a.scale;
        let f = self.kernel("attention", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&q.slice)
            .arg(&kv.slice)
            .arg(&k_rope.slice)
            .arg(&key_buf)
            .arg(&mut out.slice)
            .arg(&heads32)
            .arg(&nope)
            .arg(&rope)
            .arg(&v)
            .arg(&slots32)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(t)?, heads32, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: q holds t × heads × (nope + rope) values, kv and k_rope every cached position
        // the keys name (checked above), keys t × slots, out t × heads × v; the scores take
        // `shared` bytes.
        unsafe { launch.launch(cfg) }?;
        self.download(&out, n)
    }

    /// `x · wᵀ` through cuBLAS, f32 accumulation; the output in the dtype, or in f32 (`exact`).
    fn linear<D: Dtype>(
        &self,
        x: &Mat<f32>,
        w: &Buffer<D>,
        w_rows: usize,
        exact: bool,
    ) -> Result<Mat<f32>> {
        let input = self.upload::<D>(&x.data)?;
        let n = x.rows * w_rows;
        if n == 0 {
            return Ok(Mat::zeros(x.rows, w_rows));
        }
        let data = if exact {
            let mut out = self.alloc::<f32>(n)?;
            self.gemm(x, &input, w, w_rows, &mut out)?;
            self.download(&out, n)?
        } else {
            let mut out = self.alloc::<D>(n)?;
            self.gemm(x, &input, w, w_rows, &mut out)?;
            self.download(&out, n)?
        };
        Ok(Mat::new(x.rows, w_rows, data))
    }

    /// `out[t, w_rows] = input[t, k] · w[w_rows, k]ᵀ`: in cuBLAS's column-major terms
    /// `outᵀ = w · inputᵀ`, with `w` read transposed from its row-major storage.
    fn gemm<D: Dtype, O: Dtype>(
        &self,
        x: &Mat<f32>,
        input: &Buffer<D>,
        w: &Buffer<D>,
        w_rows: usize,
        out: &mut Buffer<O>,
    ) -> Result<()> {
        let (m, n, k) = (to_i32(w_rows)?, to_i32(x.rows)?, to_i32(x.cols)?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        let stream = &self.gpu.stream;
        let (a, _a) = w.slice.device_ptr(stream);
        let (b, _b) = input.slice.device_ptr(stream);
        let (c, _c) = out.slice.device_ptr_mut(stream);
        // SAFETY: w holds w_rows × k values, input t × k, out t × w_rows, as the leading
        // dimensions say; alpha and beta are f32 as CUBLAS_COMPUTE_32F needs.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                (&alpha) as *const f32 as *const _,
                a as *const _,
                D::CUDA,
                k,
                b as *const _,
                D::CUDA,
                k,
                (&beta) as *const f32 as *const _,
                c as *mut _,
                O::CUDA,
                m,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| {
            anyhow!(
                "cuBLAS GEMM {w_rows}×{}·{}ᵀ on {}: {e:?}",
                x.cols,
                x.rows,
                self.gpu.name
            )
        })
    }
}

fn elements(count: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (count.div_ceil(ELEMENT_THREADS), 1, 1),
        block_dim: (ELEMENT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn to_u32(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| anyhow!("{n} is past a kernel's 2^32 - 1 limit"))
}

fn to_i32(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| anyhow!("{n} is past cuBLAS's 2^31 - 1 limit"))
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        bail!("{what} has {got} values for {want} columns");
    }
    Ok(())
}

/// The NCCL communicators of the ranks' GPUs, one per rank, made at once (ncclCommInitAll).
struct Comms(Vec<Comm>);

// SAFETY: the communicators are only used under their mutex, from one thread at a time.
unsafe impl Send for Comms {}

/// Every rank's GPU.
struct Ranks {
    /// The GPUs this process drives, one per rank of `local`.
    devices: Vec<Mutex<Device>>,
    /// One communicator per local rank, in the same order.
    comms: Option<Mutex<Comms>>,
    /// The tensor-parallel ranks this process computes: all of them, or its own.
    local: Vec<usize>,
    tp: usize,
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

fn open_device(ordinal: usize) -> Result<Mutex<Device>> {
    let gpu = Gpu::open(ordinal)?;
    let blas =
        CudaBlas::new(gpu.stream.clone()).map_err(|e| anyhow!("cuBLAS on {}: {e:?}", gpu.name))?;
    gpu.stream.context().bind_to_thread()?;
    let (free, total) = cudarc::driver::result::mem_get_info()
        .map_err(|e| anyhow!("free memory of {}: {e:?}", gpu.name))?;
    Ok(Mutex::new(Device {
        gpu,
        blas,
        meter: Arc::default(),
        resident: Resident::new(free as u64, total as u64),
    }))
}

/// The CUDA backend as one rank runs it.
#[derive(Clone)]
pub struct Cuda {
    ranks: Arc<Ranks>,
    rank: usize,
    precision: Precision,
}

/// A weight on a rank's GPU.
pub struct GpuWeight {
    rank: usize,
    rows: usize,
    cols: usize,
    data: Held,
}

enum Held {
    F32(Buffer<f32>),
    Bf16(Buffer<bf16>),
    F16(Buffer<f16>),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
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
        bail!("no cuBLAS found (libcublas): put CUDA 13's libraries on LD_LIBRARY_PATH (scripts/gpu-env does)");
    }
    // SAFETY: as above.
    if ranks > 1 && !unsafe { cudarc::nccl::sys::is_culib_present() } {
        bail!(
            "no NCCL found (libnccl.so): --tp {ranks} on GPUs needs it (scripts/gpu-env links it)"
        );
    }
    Ok(())
}

impl Cuda {
    /// GPUs 0..`tp`, one per rank, at `precision` (f32, bf16 or f16).
    pub fn open(precision: Precision, tp: usize) -> Result<Cuda> {
        check_setup(precision, tp)?;
        let visible = cudarc::driver::CudaContext::device_count()? as usize;
        if tp > visible {
            bail!("--tp {tp} on GPUs needs {tp} of them, one per rank; {visible} visible");
        }
        let devices = (0..tp).map(open_device).collect::<Result<Vec<_>>>()?;
        let comms = if tp > 1 {
            let streams = devices.iter().map(|d| lock(d).gpu.stream.clone()).collect();
            let comms =
                Comm::from_devices(streams).map_err(|e| anyhow!("NCCL over {tp} GPUs: {e:?}"))?;
            Some(Mutex::new(Comms(comms)))
        } else {
            None
        };
        Ok(Cuda {
            ranks: Arc::new(Ranks {
                devices,
                comms,
                local: (0..tp).collect(),
                tp,
            }),
            rank: 0,
            precision,
        })
    }

    /// Rank `p.rank` of `p.world_size` in a process of its own, on GPU `rank` (modulo the GPUs
    /// visible), joined to the others through the NCCL id in `p.nccl_id` — the route to
    /// several nodes.
    pub fn open_rank(precision: Precision, p: &ProcessRank) -> Result<Cuda> {
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
        let device = open_device(rank % visible)?;
        let id = super::nccl_id::exchange(&p.nccl_id, rank, p.timeout)?;
        let stream = lock(&device).gpu.stream.clone();
        let comm = Comm::from_rank(stream, rank, world_size, id)
            .map_err(|e| anyhow!("NCCL rank {rank} of {world_size}: {e:?}"))?;
        Ok(Cuda {
            ranks: Arc::new(Ranks {
                devices: vec![device],
                comms: Some(Mutex::new(Comms(vec![comm]))),
                local: vec![rank],
                tp: world_size,
            }),
            rank: 0,
            precision,
        })
    }

    /// The GPUs' names, by rank.
    pub fn device_names(&self) -> Vec<String> {
        self.ranks
            .devices
            .iter()
            .map(|d| lock(d).gpu.name.clone())
            .collect()
    }

    /// How each local rank used its GPU so far.
    pub fn memory(&self) -> Vec<RankMemory> {
        self.ranks
            .devices
            .iter()
            .map(|d| {
                let d = lock(d);
                RankMemory {
                    peak_bytes: d.meter.peak.load(Ordering::Relaxed),
                    resident_bytes: d.resident.kept,
                    loaded_bytes: d.resident.loaded,
                    load_seconds: d.resident.load_seconds,
                }
            })
            .collect()
    }

    /// This rank's device, bound to the calling thread.
    fn device(&self, rank: usize) -> Result<MutexGuard<'_, Device>> {
        let device = lock(&self.ranks.devices[rank]);
        device.bind()?;
        Ok(device)
    }

    /// The NCCL all-reduce of one part per rank, each on its rank's GPU, in the dtype.
    fn nccl_all_reduce<D: Dtype>(&self, comms: &Comms, parts: &[Mat<f32>]) -> Result<Mat<f32>> {
        let local = &self.ranks.local;
        let devices: Vec<MutexGuard<'_, Device>> = (0..local.len())
            .map(|d| self.device(d))
            .collect::<Result<_>>()?;
        let sends = devices
            .iter()
            .zip(local)
            .map(|(d, &r)| d.upload::<D>(&parts[r].data))
            .collect::<Result<Vec<_>>>()?;
        let n = parts[local[0]].data.len();
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
                    comm.all_reduce(&send.slice, &mut receive.slice, &ReduceOp::Sum)
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
    fn nccl_gather<D: Dtype>(&self, comms: &Comms, own: &Mat<f32>) -> Result<Vec<Mat<f32>>> {
        let device = self.device(0)?;
        let send = device.upload::<D>(&own.data)?;
        let n = own.data.len();
        let tp = self.ranks.tp;
        let mut receive = device.alloc::<D>(n * tp)?;
        nccl_group(|| {
            comms.0[0]
                .all_gather(&send.slice, &mut receive.slice)
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

impl Backend for Cuda {
    type E = f32;
    type Weight = GpuWeight;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn hold(&self, w: Mat<f32>) -> Result<GpuWeight> {
        let device = self.device(self.rank)?;
        let data = with_dtype!(self.precision, D => D::held(device.upload::<D>(&w.data)?));
        Ok(GpuWeight {
            rank: self.rank,
            rows: w.rows,
            cols: w.cols,
            data,
        })
    }

    /// Dequantized on this rank's GPU, from blocks kept there where it can.
    fn hold_stored(&self, w: &StoredBlock<'_>) -> Result<GpuWeight> {
        let mut device = self.device(self.rank)?;
        if !device.gpu.dequantizes(w.ty()) {
            drop(device);
            return self.hold(w.dequantize()?);
        }
        let data = with_dtype!(self.precision, D => D::held(device.dequantize_stored::<D>(w)?));
        let (rows, cols) = w.shape();
        Ok(GpuWeight {
            rank: self.rank,
            rows,
            cols,
            data,
        })
    }

    fn hold_values(&self, v: Vec<f32>) -> Vec<f32> {
        with_dtype!(self.precision, D => v.into_iter().map(|x| D::from_f32(x).to_f32()).collect())
    }

    fn hold_exact(&self, v: Vec<f32>) -> Vec<f32> {
        v
    }

    fn linear(&self, x: &Mat<f32>, w: &GpuWeight) -> Result<Mat<f32>> {
        self.linear_as(x, w, false)
    }

    fn linear_exact(&self, x: &Mat<f32>, w: &GpuWeight) -> Result<Mat<f32>> {
        self.linear_as(x, w, true)
    }

    fn rms_norm(&self, x: &Mat<f32>, w: &[f32], eps: f64) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.norm::<D>(x, w, None, eps))
    }

    fn layer_norm(&self, x: &Mat<f32>, w: &[f32], b: &[f32], eps: f64) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.norm::<D>(x, w, Some(b), eps))
    }

    fn silu_mul(&self, gate: &Mat<f32>, up: &Mat<f32>) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.elementwise::<D>("silu_mul", gate, up))
    }

    fn add(&self, a: &Mat<f32>, b: &Mat<f32>) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.elementwise::<D>("add", a, b))
    }

    fn round(&self, xs: &mut [f32]) -> Result<()> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.round::<D>(xs))
    }

    fn rope(&self, m: &mut Mat<f32>, rope: &Rope<f32>, spec: RotateSpec) -> Result<()> {
        self.device(self.rank)?.rope(m, rope, spec)
    }

    fn attention(&self, a: &AttentionInputs<'_, f32>) -> Result<Vec<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.attention::<D>(a))
    }

    fn on_rank(&self, rank: usize) -> Self {
        Cuda {
            rank: rank % self.ranks.devices.len(),
            ..self.clone()
        }
    }

    fn computes(&self, rank: usize) -> bool {
        self.ranks.local.contains(&rank)
    }

    fn collectives_across_processes(&self) -> bool {
        self.ranks.local.len() < self.ranks.tp
    }

    fn gather(&self, parts: Vec<Option<Mat<f32>>>) -> Result<Vec<Mat<f32>>> {
        let ranks = &self.ranks;
        match (&ranks.comms, ranks.local.as_slice()) {
            (Some(comms), &[own]) if ranks.tp > 1 && parts.len() == ranks.tp => {
                let Some(Some(mine)) = parts.get(own) else {
                    bail!("rank {own}'s own part is missing");
                };
                let comms = lock(comms);
                with_dtype!(self.precision, D => self.nccl_gather::<D>(&comms, mine))
            }
            _ => all_computed(parts),
        }
    }

    /// NCCL across the ranks' GPUs (or processes) when there is one part per rank.
    fn all_reduce(&self, parts: &[Mat<f32>]) -> Result<Mat<f32>> {
        let shapes_agree = parts
            .iter()
            .all(|p| (p.rows, p.cols) == (parts[0].rows, parts[0].cols));
        match &self.ranks.comms {
            Some(comms) if parts.len() == self.ranks.tp && shapes_agree => {
                let comms = lock(comms);
                with_dtype!(self.precision, D => self.nccl_all_reduce::<D>(&comms, parts))
            }
            _ => sum_in_rank_order(self, parts),
        }
    }
}

impl Cuda {
    fn linear_as(&self, x: &Mat<f32>, w: &GpuWeight, exact: bool) -> Result<Mat<f32>> {
        if x.cols != w.cols {
            bail!(
                "linear: input has {} features, weight expects {}",
                x.cols,
                w.cols
            );
        }
        let device = self.device(w.rank)?;
        match &w.data {
            Held::F32(b) => device.linear(x, b, w.rows, exact),
            Held::Bf16(b) => device.linear(x, b, w.rows, exact),
            Held::F16(b) => device.linear(x, b, w.rows, exact),
        }
    }
}
