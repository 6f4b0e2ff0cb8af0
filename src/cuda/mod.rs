//! The GPU side, through cudarc with CUDA loaded at run time: the one binary builds and runs
//! without CUDA (a CUDA command then says that no driver was found) and uses the GPU where there
//! is one. Kernels are `kernels/*.cu`, embedded in the binary and compiled by NVRTC to CUBIN for
//! the device's own compute capability, once per process.

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtrMut,
    DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::weights::GgmlType;

mod attention;
pub mod backend;
pub mod check;
mod device;
mod dtype;
mod expert_sum;
mod launch;
pub mod memory;
mod nccl_id;
mod nvrtc;
pub mod ranks;
mod resident;
mod stats;

pub use backend::Cuda;

/// The kernels, as compiled into the binary: file name and source.
const DEQUANT_SRC: &str = include_str!("../../kernels/dequant.cu");
const OPS_SRC: &str = include_str!("../../kernels/ops.cu");
pub const KERNEL_SOURCES: [(&str, &str); 2] = [("dequant.cu", DEQUANT_SRC), ("ops.cu", OPS_SRC)];

/// The headers the kernels include, as compiled into the binary: the name they are included by,
/// and source. NVRTC gets them with every kernel file.
pub const KERNEL_HEADERS: [(&str, &str); 1] =
    [("dtypes.cuh", include_str!("../../kernels/dtypes.cuh"))];

/// Timed launches per [`Gpu::dequantize`] call; their median is its time.
const TIMED_RUNS: usize = 3;

/// Bytes written between timed launches: several times the L2 cache (50 MB on an H100, 60 MB
/// on an H200), so that each timed launch reads its blocks from device memory.
const L2_FLUSH_BYTES: usize = 256 << 20;

/// Threads per thread block of the kernels of `kernels/dequant.cu` (its `DQ_THREADS`).
const DQ_THREADS: u32 = 256;

/// Output values per thread block of those kernels (its `DQ_TILE`): 16 per thread, in 16-byte
/// groups (four f32 or eight bf16/f16); a quantized type's tile is 128 blocks of 32 or 16 of 256.
const DQ_TILE: usize = 4096;

/// The launch shape of every kernel of `kernels/dequant.cu` for `n` values: a thread block per
/// tile of [`DQ_TILE`] values, the last one partly filled.
fn dequant_launch(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(DQ_TILE) as u32, 1, 1),
        block_dim: (DQ_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// An output dtype of the kernels of `kernels/dequant.cu`: `dq_q4_k_bf16` writes bf16, each value
/// the f32 one rounded to nearest even (`store` of `kernels/dtypes.cuh`).
pub trait DequantOutput: DeviceRepr + ValidAsZeroBits + Copy {
    /// The suffix of its kernels' names after the type's base name ([`dequant_kernel`]).
    const SUFFIX: &'static str;
    /// The value, exactly.
    fn to_f32(self) -> f32;
}

impl DequantOutput for f32 {
    const SUFFIX: &'static str = "f32";
    fn to_f32(self) -> f32 {
        self
    }
}

impl DequantOutput for half::bf16 {
    const SUFFIX: &'static str = "bf16";
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

impl DequantOutput for half::f16 {
    const SUFFIX: &'static str = "f16";
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// The base name of the kernels in `kernels/dequant.cu` that dequantize `ty`: `dq_q4_k`, whose
/// kernel writing output `O` is `dq_q4_k_{O::SUFFIX}`.
pub fn dequant_kernel(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "dq_f32",
        GgmlType::F16 => "dq_f16",
        GgmlType::BF16 => "dq_bf16",
        GgmlType::Q8_0 => "dq_q8_0",
        GgmlType::Q4_0 => "dq_q4_0",
        GgmlType::Q4_1 => "dq_q4_1",
        GgmlType::Q5_0 => "dq_q5_0",
        GgmlType::Q5_1 => "dq_q5_1",
        GgmlType::Q2_K => "dq_q2_k",
        GgmlType::Q3_K => "dq_q3_k",
        GgmlType::Q4_K => "dq_q4_k",
        GgmlType::Q5_K => "dq_q5_k",
        GgmlType::Q6_K => "dq_q6_k",
        GgmlType::IQ4_NL => "dq_iq4_nl",
        GgmlType::IQ4_XS => "dq_iq4_xs",
        _ => return None,
    })
}

/// Every kernel source compiled by NVRTC for `arch` (`sm_90`): file name and CUBIN. Needs NVRTC
/// only, no GPU.
pub fn compile_kernels(arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    // SAFETY: only tries to load the library by its usual names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!("no NVRTC found (libnvrtc): put CUDA 13's libraries on LD_LIBRARY_PATH");
    }
    KERNEL_SOURCES
        .iter()
        .map(|&(file, src)| Ok((file, nvrtc::cubin(src, file, arch)?)))
        .collect()
}

/// One GPU with the kernels loaded.
#[derive(Clone)]
pub struct Gpu {
    stream: Arc<CudaStream>,
    /// Marks how far the stream's work has been queued, for other streams to wait behind (one
    /// event recorded again each time: a wait behind a later mark is still behind the earlier).
    mark: Arc<CudaEvent>,
    dequant: Arc<CudaModule>,
    ops: Arc<CudaModule>,
    /// `NVIDIA H200 (sm_90)`.
    pub name: String,
}

/// Whether the CUDA driver and NVRTC libraries can be loaded, and why not.
fn libraries() -> Result<()> {
    // SAFETY: only tries to load the libraries by their usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        bail!(
            "no CUDA driver found (libcuda): the CUDA commands need an NVIDIA GPU and its driver"
        );
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        bail!(
            "no NVRTC found (libnvrtc): put CUDA 13's libraries on LD_LIBRARY_PATH \
             (scripts/gpu/gpu-env does)"
        );
    }
    Ok(())
}

impl Gpu {
    /// GPU `ordinal`, its kernels compiled for its compute capability.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        libraries()?;
        let ctx = CudaContext::new(ordinal).with_context(|| format!("CUDA device {ordinal}"))?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = format!("sm_{major}{minor}");
        let [dequant, ops] = KERNEL_SOURCES.map(|(file, src)| {
            let cubin = nvrtc::cubin_once(src, file, &arch)?;
            ctx.load_module(Ptx::from_binary(cubin.to_vec()))
                .with_context(|| format!("loading the kernels of {file}"))
        });
        let name = format!("{} ({arch})", ctx.name()?);
        keep_freed_memory(&ctx).with_context(|| format!("the memory pool of {name}"))?;
        let mark = ctx.new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        Ok(Gpu {
            stream: ctx.default_stream(),
            mark: Arc::new(mark),
            dequant: dequant?,
            ops: ops?,
            name,
        })
    }

    /// Kernel `name` of `kernels/ops.cu`.
    fn ops_kernel(&self, name: &str) -> Result<CudaFunction> {
        self.ops
            .load_function(name)
            .with_context(|| format!("kernel {name} of ops.cu"))
    }

    /// The kernel dequantizing `ty` to `O`.
    fn dequant_function<O: DequantOutput>(&self, ty: GgmlType) -> Result<CudaFunction> {
        let base = dequant_kernel(ty).ok_or_else(|| anyhow!("no GPU dequantizer for {ty}"))?;
        let name = format!("{base}_{}", O::SUFFIX);
        self.dequant
            .load_function(&name)
            .with_context(|| format!("kernel {name} of dequant.cu"))
    }

    /// Whether there is a GPU dequantizer for `ty`.
    pub fn dequantizes(&self, ty: GgmlType) -> bool {
        self.dequant_function::<f32>(ty).is_ok()
    }

    /// Queues on this GPU's stream the dequantization of whole blocks of `ty` in `src` to the
    /// first `n` values of `dst`, in one launch. Both are allocations of their own, so 16-byte
    /// aligned as the kernels need.
    pub fn launch_dequant<O: DequantOutput>(
        &self,
        ty: GgmlType,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<O>,
        n: usize,
    ) -> Result<()> {
        let f = self.dequant_function::<O>(ty)?;
        let expected = (n / ty.block_size()) * ty.type_size();
        if !n.is_multiple_of(ty.block_size()) || src.len() != expected {
            bail!("{ty}: {} bytes do not hold {n} values", src.len());
        }
        if dst.len() < n {
            bail!("{n} values do not fit in {} of output", dst.len());
        }
        if n > u32::MAX as usize {
            bail!("{n} values in one launch: at most 2^32 - 1");
        }
        if n == 0 {
            // No blocks, and a launch of no thread blocks is an error.
            return Ok(());
        }
        let count = n as u64;
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(src).arg(dst).arg(&count);
        // SAFETY: the kernel reads the `n / block_size` whole blocks of `src` and writes the first
        // `n` values of `dst`, both sized as checked above.
        unsafe { launch.launch(dequant_launch(n)) }?;
        Ok(())
    }

    /// Whole blocks of `ty` in `src` to `n` values of `O` on the GPU, returned widened to f32,
    /// and the kernel's time in milliseconds (the copies to and from the GPU aside): the median
    /// of `TIMED_RUNS` launches, each after an untimed warm-up launch and a write of
    /// `L2_FLUSH_BYTES` that leaves neither the blocks nor the output in the L2 cache. The
    /// output is poisoned (all bits set: a NaN in every dtype) before the first launch, so a
    /// value the kernel never writes shows up in the check.
    pub fn dequantize<O: DequantOutput>(
        &self,
        ty: GgmlType,
        src: &[u8],
        n: usize,
    ) -> Result<(Vec<f32>, f32)> {
        if n == 0 {
            self.dequant_function::<O>(ty)?;
            return Ok((Vec::new(), 0.0));
        }
        let input = self.stream.clone_htod(src)?;
        // SAFETY: every byte is set by the memset right after.
        let mut out = unsafe { self.stream.alloc::<O>(n) }?;
        self.poison(&mut out)?;
        // Untimed: the first launch of a kernel in a process also loads it.
        self.launch_dequant(ty, &input, &mut out, n)?;
        // SAFETY: only ever written (by the memsets below), never read.
        let mut flush = unsafe { self.stream.alloc::<u8>(L2_FLUSH_BYTES) }?;
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut events = Vec::with_capacity(TIMED_RUNS);
        for _ in 0..TIMED_RUNS {
            // The memset also keeps the GPU busy while the launch is queued behind it, so the
            // time between the events is the kernel's alone, not the host's launch latency.
            self.stream.memset_zeros(&mut flush)?;
            let start = self.stream.record_event(timing)?;
            self.launch_dequant(ty, &input, &mut out, n)?;
            events.push((start, self.stream.record_event(timing)?));
        }
        let mut ms = events
            .iter()
            .map(|(start, end)| start.elapsed_ms(end))
            .collect::<Result<Vec<f32>, _>>()?;
        ms.sort_by(f32::total_cmp);
        let values = self.stream.clone_dtoh(&out)?;
        Ok((
            values.into_iter().map(O::to_f32).collect(),
            ms[TIMED_RUNS / 2],
        ))
    }

    /// Every bit of `out` set: a NaN that no real weights decode to.
    fn poison<T: DeviceRepr>(&self, out: &mut CudaSlice<T>) -> Result<()> {
        let bytes = out.num_bytes();
        let (ptr, _record) = out.device_ptr_mut(&self.stream);
        // SAFETY: `ptr` is `bytes` bytes of device memory owned by `out`, on this stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(ptr, 0xff, bytes, self.stream.cu_stream())
        }?;
        Ok(())
    }

    /// Device-to-device copy bandwidth in GB/s (bytes read plus bytes written), on a 256 MiB
    /// buffer, the best of a few copies: what a memory-bound kernel can reach.
    pub fn copy_bandwidth(&self) -> Result<f64> {
        const BYTES: usize = 256 << 20;
        let src = self.stream.alloc_zeros::<u8>(BYTES)?;
        let mut dst = self.stream.alloc_zeros::<u8>(BYTES)?;
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let mut best = f32::INFINITY;
        for _ in 0..5 {
            let start = self.stream.record_event(timing)?;
            self.stream.memcpy_dtod(&src, &mut dst)?;
            let end = self.stream.record_event(timing)?;
            best = best.min(start.elapsed_ms(&end)?);
        }
        Ok(2.0 * BYTES as f64 / (f64::from(best) * 1e-3) / 1e9)
    }
}

/// Memory a stream frees stays in the device's pool for its next allocation: by default the pool
/// hands it back to the driver at every synchronization, and the next large allocation then
/// maps it again (100–200 µs each for an attention's scores, several times a layer).
fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys::{self, CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD};
    ctx.bind_to_thread()?;
    let mut pool = std::ptr::null_mut();
    let mut keep = u64::MAX;
    // SAFETY: the pool handle is written by the driver for this context's device; the
    // attribute takes a pointer to a u64, read during the call.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
        .result()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_the_host_asks_for_is_in_the_embedded_source() {
        let types = [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_NL,
            GgmlType::IQ4_XS,
        ];
        for ty in types {
            let base = dequant_kernel(ty).unwrap();
            let name = base.strip_prefix("dq_").unwrap();
            assert!(DEQUANT_SRC.contains(&format!("\nDQ({name}, ")), "{base}");
        }
        // No source type the host does not know of.
        assert_eq!(DEQUANT_SRC.matches("\nDQ(").count(), types.len());
        assert_eq!(dequant_kernel(GgmlType::IQ2_XXS), None);
        // `DQ` emits a kernel per output, named with the host's suffixes.
        assert!(
            DEQUANT_SRC.contains("__global__ void __launch_bounds__(DQ_THREADS, DQ_BLOCKS_PER_SM)")
        );
        assert!(DEQUANT_SRC.contains(" dq_##name##_##O(const u8* __restrict__ src, O* "));
        for suffix in [f32::SUFFIX, half::bf16::SUFFIX, half::f16::SUFFIX] {
            assert!(
                DEQUANT_SRC.contains(&format!("DQ_OUT(name, {suffix}, run)")),
                "{suffix}"
            );
        }
    }

    #[test]
    fn the_launch_shape_is_the_kernels_own() {
        assert!(DEQUANT_SRC.contains(&format!("#define DQ_THREADS {DQ_THREADS}\n")));
        assert!(DEQUANT_SRC.contains(&format!("#define DQ_TILE {DQ_TILE}\n")));
        let c = dequant_launch(DQ_TILE + 32);
        assert_eq!((c.grid_dim, c.block_dim), ((2, 1, 1), (DQ_THREADS, 1, 1)));
    }
}
