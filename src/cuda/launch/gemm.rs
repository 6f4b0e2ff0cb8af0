//! The cuBLAS GEMMs: a linear layer's one GEMM and the grouped GEMM of many small problems that
//! the routed experts' MLPs use, with the raw calls into cuBLAS they share.

use anyhow::{anyhow, Result};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::to_i32;
use crate::cuda::device::Device;
use crate::cuda::dtype::Dtype;
use crate::cuda::memory::Buffer;
use crate::exec::mat::Mat;

impl Device {
    /// `x · wᵀ` through cuBLAS, f32 accumulation; the output in the dtype, or in f32 (`exact`).
    pub(in crate::cuda) fn linear<D: Dtype>(
        &self,
        x: &Mat<f32>,
        w: &Buffer<D>,
        w_rows: usize,
        exact: bool,
    ) -> Result<Mat<f32>> {
        let n = x.rows * w_rows;
        if n == 0 {
            return Ok(Mat::zeros(x.rows, w_rows));
        }
        let input = self.input::<D>(x)?;
        if exact {
            let mut out = self.alloc_written::<f32>(n)?;
            self.gemm((x.rows, x.cols), &*input.slice, w, w_rows, &mut *out.slice)?;
            self.output(x.rows, w_rows, out)
        } else {
            let mut out = self.alloc_written::<D>(n)?;
            self.gemm((x.rows, x.cols), &*input.slice, w, w_rows, &mut *out.slice)?;
            self.output(x.rows, w_rows, out)
        }
    }

    /// Every problem's `input · weightᵀ`, f32 accumulation, outputs in the dtype: the problems
    /// of fewer than [`ALONE_TOKENS`] tokens in one cuBLAS grouped GEMM (each problem a group of
    /// one, their operand addresses sent to the GPU in one copy), the others a GEMM each.
    pub(super) fn grouped_gemm<D: Dtype>(&self, problems: &[GroupedGemm<'_, D>]) -> Result<()> {
        let (alone, grouped): (Vec<&GroupedGemm<'_, D>>, Vec<&GroupedGemm<'_, D>>) =
            problems.iter().partition(|p| p.t >= ALONE_TOKENS);
        for p in alone {
            let (w, _w) = p.weight.device_ptr(&self.gpu.stream);
            self.gemm_at::<D, D>((p.rows, p.t, p.k), [w, p.input, p.out])?;
        }
        let count = grouped.len();
        if count == 0 {
            return Ok(());
        }
        let stream = &self.gpu.stream;
        let mut guards = Vec::with_capacity(count);
        let mut addresses = vec![0u64; 3 * count];
        for (p, problem) in grouped.iter().enumerate() {
            let (w, guard) = problem.weight.device_ptr(stream);
            guards.push(guard);
            addresses[p] = w;
            addresses[count + p] = problem.input;
            addresses[2 * count + p] = problem.out;
        }
        let on_gpu = self.upload_exact(&addresses)?;
        let (base, _base) = on_gpu.slice.device_ptr(stream);
        let int = |f: fn(&GroupedGemm<'_, D>) -> usize| -> Result<Vec<i32>> {
            grouped.iter().map(|p| to_i32(f(p))).collect()
        };
        let (m, n, k) = (int(|p| p.rows)?, int(|p| p.t)?, int(|p| p.k)?);
        let (lda, ldc) = (k.clone(), m.clone());
        let transposed = vec![cublasOperation_t::CUBLAS_OP_T; count];
        let plain = vec![cublasOperation_t::CUBLAS_OP_N; count];
        let (alpha, beta, sizes) = (vec![1.0f32; count], vec![0.0f32; count], vec![1i32; count]);
        let pointer = size_of::<u64>() as u64;
        // SAFETY: each problem's weight holds rows × k values, its input t × k and its output
        // t × rows (the callers' layouts); the address arrays are on the GPU as cuBLAS needs,
        // the other arrays on the host, one entry per group of one problem; alpha and beta are
        // f32 as CUBLAS_COMPUTE_32F needs.
        unsafe {
            cudarc::cublas::sys::cublasGemmGroupedBatchedEx(
                *self.blas.handle(),
                transposed.as_ptr(),
                plain.as_ptr(),
                m.as_ptr(),
                n.as_ptr(),
                k.as_ptr(),
                alpha.as_ptr() as *const _,
                base as *const *const _,
                D::CUDA,
                lda.as_ptr(),
                (base + count as u64 * pointer) as *const *const _,
                D::CUDA,
                k.as_ptr(),
                beta.as_ptr() as *const _,
                (base + 2 * count as u64 * pointer) as *const *mut _,
                D::CUDA,
                ldc.as_ptr(),
                to_i32(count)?,
                sizes.as_ptr(),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
            .result()
        }
        .map_err(|e| anyhow!("cuBLAS grouped GEMM of {count} on {}: {e:?}", self.gpu.name))
    }

    fn gemm<D: Dtype, O: Dtype>(
        &self,
        (t, cols): (usize, usize),
        input: &impl DevicePtr<D>,
        w: &Buffer<D>,
        w_rows: usize,
        out: &mut impl DevicePtrMut<O>,
    ) -> Result<()> {
        let stream = &self.gpu.stream;
        let (a, _a) = w.slice.device_ptr(stream);
        let (b, _b) = input.device_ptr(stream);
        let (c, _c) = out.device_ptr_mut(stream);
        self.gemm_at::<D, O>((w_rows, t, cols), [a, b, c])
    }

    /// `out = input · weightᵀ` at those addresses on this GPU (`[weight, input, out]`): weight
    /// `rows × k` and input `t × k` in `D`, out `t × rows` in `O`, f32 accumulation.
    fn gemm_at<D: Dtype, O: Dtype>(
        &self,
        (rows, t, cols): (usize, usize, usize),
        [a, b, c]: [u64; 3],
    ) -> Result<()> {
        let (m, n, k) = (to_i32(rows)?, to_i32(t)?, to_i32(cols)?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the callers' addresses hold rows × k, t × k and t × rows values, as the
        // leading dimensions say; alpha and beta are f32 as CUBLAS_COMPUTE_32F needs.
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
        .map_err(|e| anyhow!("cuBLAS GEMM {rows}×{cols}·{t}ᵀ on {}: {e:?}", self.gpu.name))
    }
}

/// Tokens from which a routed expert's GEMMs leave the grouped launch for one each. cuBLAS's
/// grouped GEMM runs Ampere's kernel of 128 × 64 tiles on Hopper too, which reads an expert's
/// weights again for every 64 of its tokens, where a GEMM of one expert's shape gets one of
/// cuBLAS's Hopper kernels: on an H100, a 4-layer forward at 512 tokens whose last MoE layer
/// sent 4072 of its 4096 routed rows to 8 experts spent 1.3 ms (6%) less in the GPU's kernels,
/// every output the same.
const ALONE_TOKENS: usize = 128;

/// One problem of [`Device::grouped_gemm`]: `out = input · weightᵀ`, `input` `t × k` and `out`
/// `t × rows` row-major at those addresses on this GPU.
pub(super) struct GroupedGemm<'a, D: Dtype> {
    pub(super) weight: &'a cudarc::driver::CudaSlice<D>,
    pub(super) rows: usize,
    pub(super) input: u64,
    pub(super) t: usize,
    pub(super) k: usize,
    pub(super) out: u64,
}
