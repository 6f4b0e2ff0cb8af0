//! The ops on one rank's GPU: launches of the kernels of `kernels/ops.cu` (norms, element-wise
//! ops, RoPE, attention, the DSA indexer's scores) and cuBLAS GEMMs, host matrices in and out.

use anyhow::{anyhow, bail, Result};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::{bf16, f16};
use rayon::prelude::*;

use super::device::Device;
use super::dtype::Dtype;
use super::memory::Buffer;
use crate::exec::backend::HeadCut;
use crate::exec::mat::Mat;
use crate::exec::ops::indexer_core::IndexerInputs;
use crate::exec::ops::rope::{Rope, RotateSpec};
use crate::exec::passes::Passes;
use crate::model::kv_b::KvBDims;

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

    /// RMSNorm (no bias) or LayerNorm (`bias` Some) of every row of `x`.
    pub(super) fn norm<D: Dtype>(
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
        let (input, weight) = (self.input::<D>(x)?, self.upload::<D>(w)?);
        // Every row normalized whole.
        let mut out = self.alloc_written::<D>(x.len())?;
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
                    .arg(&*input.slice)
                    .arg(&*weight.slice)
                    .arg(&mut *out.slice)
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
                    .arg(&*input.slice)
                    .arg(&*weight.slice)
                    .arg(&*bias.slice)
                    .arg(&mut *out.slice)
                    .arg(&cols)
                    .arg(&eps);
                // SAFETY: as above, with cols bias values.
                unsafe { launch.launch(cfg) }?;
            }
        }
        self.output(x.rows, x.cols, out)
    }

    /// An element-wise op of two equally shaped matrices (`silu_mul`, `add`).
    pub(super) fn elementwise<D: Dtype>(
        &self,
        op: &str,
        a: &Mat<f32>,
        b: &Mat<f32>,
    ) -> Result<Mat<f32>> {
        if (a.rows, a.cols) != (b.rows, b.cols) {
            bail!(
                "{op}: {}×{} and {}×{} differ",
                a.rows,
                a.cols,
                b.rows,
                b.cols
            );
        }
        let n = a.len();
        if n == 0 {
            return Ok(a.clone());
        }
        let (x, y) = (self.input::<D>(a)?, self.input::<D>(b)?);
        let out = self.elementwise_here(op, &x, &y, n)?;
        self.output(a.rows, a.cols, out)
    }

    /// An element-wise op of the first `n` values of two buffers already on this GPU, `n > 0`
    /// and within both (the callers' checks).
    fn elementwise_here<D: Dtype>(
        &self,
        op: &str,
        x: &Buffer<D>,
        y: &Buffer<D>,
        n: usize,
    ) -> Result<Buffer<D>> {
        let mut out = self.alloc_written::<D>(n)?;
        let count = to_u32(n)?;
        let f = self.kernel(op, D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&*x.slice)
            .arg(&*y.slice)
            .arg(&mut *out.slice)
            .arg(&count);
        // SAFETY: n values in each input and the output.
        unsafe { launch.launch(elements(count)) }?;
        Ok(out)
    }

    /// kv_b (`[heads · (nope + v), kv_lora]`) assembled from llama.cpp's split `attn_k_b` and
    /// `attn_v_b`, dequantized here to f32, and rounded to the dtype.
    pub(super) fn assemble_kv_b<D: Dtype>(
        &self,
        k_b: &Buffer<f32>,
        v_b: &Buffer<f32>,
        d: KvBDims,
    ) -> Result<Buffer<D>> {
        for (what, got, want) in [
            ("attn_k_b", k_b.slice.len(), d.k_b_len()),
            ("attn_v_b", v_b.slice.len(), d.v_b_len()),
        ] {
            if got < want {
                bail!("kv_b assembly: {what} has {got} values, {want} needed");
            }
        }
        let n = d.kv_b_len();
        let mut out = self.alloc::<D>(n)?;
        if n == 0 {
            return Ok(out);
        }
        let f = self.kernel("assemble_kv_b", D::SUFFIX)?;
        let (kv_lora, nope, v, count) = (
            to_u32(d.kv_lora)?,
            to_u32(d.nope)?,
            to_u32(d.v)?,
            to_u32(n)?,
        );
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&*k_b.slice)
            .arg(&*v_b.slice)
            .arg(&mut *out.slice)
            .arg(&kv_lora)
            .arg(&nope)
            .arg(&v)
            .arg(&count);
        // SAFETY: the two inputs hold the split form of `d` (checked above), the output kv_b's
        // `n` values.
        unsafe { launch.launch(elements(count)) }?;
        Ok(out)
    }

    /// `m`'s rows with RoPE, a new matrix (f32 in and out, as the caller rounds).
    pub(super) fn rope(
        &self,
        m: &Mat<f32>,
        rope: &Rope<f32>,
        spec: RotateSpec,
    ) -> Result<Mat<f32>> {
        let half = rope.inv_freq().len();
        if spec.width == 0
            || !m.cols.is_multiple_of(spec.width)
            || spec.offset + 2 * half > spec.width
        {
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
            return Ok(m.clone());
        }
        let mut x = self.widened(m)?;
        let freq = self.upload::<f32>(rope.inv_freq())?;
        let f = self.kernel("rope", "f32")?;
        let (rows, width, heads32) = (to_u32(m.rows)?, to_u32(spec.width)?, to_u32(heads)?);
        let (offset, half32, start) = (to_u32(spec.offset)?, to_u32(half)?, to_u32(spec.start)?);
        let (interleaved, scale) = (u32::from(spec.interleaved), rope.scale());
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&mut *x.slice)
            .arg(&*freq.slice)
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
        self.output(m.rows, m.cols, x)
    }

    /// [`crate::exec::backend::Backend::head_columns`] of rows held here in `D`; `None` where
    /// they are not (the host cuts them).
    pub(super) fn head_columns<D: Dtype>(
        &self,
        m: &Mat<f32>,
        cut: HeadCut,
    ) -> Result<Option<Mat<f32>>> {
        let Some(x) = self.twin_here::<D>(m) else {
            return Ok(None);
        };
        let cols = cut.heads_in(m.cols)? * cut.len;
        let n = m.rows * cols;
        if n == 0 {
            return Ok(Some(Mat::zeros(m.rows, cols)));
        }
        let mut out = self.alloc_written::<D>(n)?;
        let (width, from) = (to_u32(cut.width)?, to_u32(cut.from)?);
        let (len, count) = (to_u32(cut.len)?, to_u32(n)?);
        let f = self.kernel("head_columns", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&*x.slice)
            .arg(&mut *out.slice)
            .arg(&width)
            .arg(&from)
            .arg(&len)
            .arg(&count);
        // SAFETY: `x` holds rows × heads × width values, `out` rows × heads × len, every read
        // inside its head (`heads_in` checked the cut).
        unsafe { launch.launch(elements(count)) }?;
        self.output(m.rows, cols, out).map(Some)
    }

    /// `m` as f32 on this GPU, for an op that computes in f32 and writes its input: its twin
    /// here widened by a kernel (a query left here by its projection is not fetched, widened
    /// and sent back), else its values uploaded.
    fn widened(&self, m: &Mat<f32>) -> Result<Buffer<f32>> {
        let n = m.len();
        if n > 0 {
            if let Some(x) = self.twin_here::<bf16>(m) {
                return self.widen_here(x, n);
            }
            if let Some(x) = self.twin_here::<f16>(m) {
                return self.widen_here(x, n);
            }
            if let Some(x) = self.twin_here::<f32>(m) {
                return self.widen_here(x, n);
            }
        }
        self.upload::<f32>(m.fetched()?)
    }

    /// A cache tensor's passes as f32 on this GPU ([`Self::widened`] of a single pass, a
    /// prompt's; several uploaded one after another).
    fn widened_passes(&self, passes: Passes<'_, f32>) -> Result<Buffer<f32>> {
        match passes.0 {
            [only] => self.widened(only),
            several => {
                let rows = several
                    .iter()
                    .map(|m| m.fetched())
                    .collect::<Result<Vec<_>>>()?;
                self.upload_parts::<f32>(&rows)
            }
        }
    }

    /// The first `n > 0` values of `x` (on this GPU) as a new f32 buffer.
    pub(super) fn widen_here<D: Dtype>(&self, x: &Buffer<D>, n: usize) -> Result<Buffer<f32>> {
        let mut out = self.alloc_written::<f32>(n)?;
        let count = to_u32(n)?;
        let f = self.kernel("widen", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch.arg(&*x.slice).arg(&mut *out.slice).arg(&count);
        // SAFETY: `x` holds at least `n` values (its twin's length), `out` `n`.
        unsafe { launch.launch(elements(count)) }?;
        Ok(out)
    }

    /// `x · wᵀ` through cuBLAS, f32 accumulation; the output in the dtype, or in f32 (`exact`).
    pub(super) fn linear<D: Dtype>(
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

    /// Gated MLPs `down(silu(x · gateᵀ) ⊙ x · upᵀ)` on rows of `x` (routed experts), shapes and
    /// rows checked by the caller: `x` read from its twin or sent once, each job's rows picked
    /// out here into one buffer, every output fetched in one copy, the intermediates kept here
    /// in the dtype, rounded as the separate ops round them. Each job's GEMMs are those it
    /// would get on its own, so its values are too. A single MLP on all of `x` (a dense
    /// layer's) leaves its output's twin.
    pub(super) fn mlps<D: Dtype>(
        &self,
        x: &Mat<f32>,
        jobs: &[GpuMlp<'_, D>],
    ) -> Result<Vec<Mat<f32>>> {
        let source = self.input::<D>(x)?;
        let whole = matches!(jobs, [GpuMlp { rows: None, .. }]);
        let picked = if whole {
            None
        } else {
            Some(self.pick_rows(x, &source, jobs)?)
        };
        let input = picked.as_ref().unwrap_or(&*source);
        let t_of = |j: &GpuMlp<'_, D>| j.rows.map_or(x.rows, <[usize]>::len);
        let out_len = |j: &GpuMlp<'_, D>| t_of(j) * j.out_rows;
        // Where this GPU runs alone each output gets its own buffer, left here as its matrix's
        // twin (the experts' weighted sum reads them here); otherwise one buffer for all,
        // fetched in one copy.
        let own_buffers = whole || self.lazy_outputs;
        let lens: Vec<usize> = jobs.iter().map(out_len).collect();
        let total: usize = lens.iter().sum();
        let outs = if own_buffers {
            lens.clone()
        } else {
            vec![total]
        };
        // A job with no intermediate features (or no inputs) writes nothing: its zeros must be
        // there already.
        let mut outs = outs
            .into_iter()
            .map(|n| {
                if jobs.iter().all(|j| j.inner > 0) {
                    self.alloc_written::<D>(n)
                } else {
                    self.alloc::<D>(n)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        // Where each job's input rows, intermediates and output start in their buffers.
        let starts_of = |len: &dyn Fn(&GpuMlp<'_, D>) -> usize| -> Vec<usize> {
            jobs.iter()
                .scan(0, |at, j| {
                    let start = *at;
                    *at += len(j);
                    Some(start)
                })
                .collect()
        };
        let cols = x.cols;
        let (at_in, at_mid) = (
            starts_of(&|j| t_of(j) * cols),
            starts_of(&|j| t_of(j) * j.inner),
        );
        let at_out = if own_buffers {
            vec![0; jobs.len()]
        } else {
            starts_of(&out_len)
        };
        let live: Vec<usize> = (0..jobs.len())
            .filter(|&i| t_of(&jobs[i]) * jobs[i].inner > 0 && jobs[i].out_rows > 0)
            .collect();
        let mid: usize = jobs.iter().map(|j| t_of(j) * j.inner).sum();
        if !live.is_empty() {
            // Every job's gate and up in one grouped GEMM, SiLU·up over all of them at once,
            // every down in another: three launches a trip, where each job's own were four.
            let (mut g, mut u) = (self.alloc_written::<D>(mid)?, self.alloc_written::<D>(mid)?);
            let stream = &self.gpu.stream;
            let at = |ptr: u64, values: usize| ptr + (values * size_of::<D>()) as u64;
            {
                let (x_ptr, _x) = input.slice.device_ptr(stream);
                let (g_ptr, _g) = g.slice.device_ptr_mut(stream);
                let (u_ptr, _u) = u.slice.device_ptr_mut(stream);
                let mut problems = Vec::with_capacity(2 * live.len());
                for (w, out) in [(0, g_ptr), (1, u_ptr)] {
                    for &i in &live {
                        let j = &jobs[i];
                        problems.push(GroupedGemm {
                            weight: &*j.weights[w].slice,
                            rows: j.inner,
                            input: at(x_ptr, at_in[i]),
                            t: t_of(j),
                            k: cols,
                            out: at(out, at_mid[i]),
                        });
                    }
                }
                self.grouped_gemm(&problems)?;
            }
            let h = self.elementwise_here("silu_mul", &g, &u, mid)?;
            let (h_ptr, _h) = h.slice.device_ptr(stream);
            let (out_ptrs, _outs): (Vec<u64>, Vec<_>) = outs
                .iter_mut()
                .map(|out| out.slice.device_ptr_mut(stream))
                .unzip();
            let mut problems = Vec::with_capacity(live.len());
            for &i in &live {
                let j = &jobs[i];
                let out = out_ptrs[if own_buffers { i } else { 0 }];
                problems.push(GroupedGemm {
                    weight: &*j.weights[2].slice,
                    rows: j.out_rows,
                    input: at(h_ptr, at_mid[i]),
                    t: t_of(j),
                    k: j.inner,
                    out: at(out, at_out[i]),
                });
            }
            self.grouped_gemm(&problems)?;
        }
        if own_buffers {
            return jobs
                .iter()
                .zip(outs)
                .map(|(j, out)| self.output(t_of(j), j.out_rows, out))
                .collect();
        }
        let all = self.download(&outs[0], total)?;
        // Each job's rows cut out of the one download, jobs in parallel (a 512-token MoE
        // layer's outputs are tens of millions of values).
        Ok(jobs
            .par_iter()
            .zip(at_out)
            .map(|(j, start)| {
                Mat::new(t_of(j), j.out_rows, all[start..start + out_len(j)].to_vec())
            })
            .collect())
    }

    /// Every job's rows of `x` (on this GPU as `source`) one after another in a new buffer:
    /// only their indices are sent (a routed expert's rows were gathered on the host and
    /// uploaded, eight times the values of `x` at GLM-5's top-8).
    fn pick_rows<D: Dtype>(
        &self,
        x: &Mat<f32>,
        source: &Buffer<D>,
        jobs: &[GpuMlp<'_, D>],
    ) -> Result<Buffer<D>> {
        let mut rows = Vec::new();
        for j in jobs {
            match j.rows {
                Some(r) => rows.extend(r.iter().map(|&r| to_u32(r)).collect::<Result<Vec<_>>>()?),
                None => rows.extend(0..to_u32(x.rows)?),
            }
        }
        let n = rows.len() * x.cols;
        let mut out = self.alloc_written::<D>(n)?;
        if n == 0 {
            return Ok(out);
        }
        let rows = self.upload_exact(&rows)?;
        let (cols, count) = (to_u32(x.cols)?, to_u32(n)?);
        let f = self.kernel("gather_rows", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&*source.slice)
            .arg(&*rows.slice)
            .arg(&mut *out.slice)
            .arg(&cols)
            .arg(&count);
        // SAFETY: every row index is below `x.rows` (the caller's check) and `source` holds
        // x's rows × cols values; `out` holds one row of cols values per index.
        unsafe { launch.launch(elements(count)) }?;
        Ok(out)
    }

    /// The DSA indexer's scores (see [`IndexerInputs`]) in f32, in the CPU's order, one thread
    /// per query and key; `None` where a query's heads do not fit in a block's shared memory.
    pub(super) fn indexer_scores(&self, a: &IndexerInputs<'_, f32>) -> Result<Option<Mat<f32>>> {
        let (t, total, width) = (a.q.rows, a.positions(), a.heads * a.dim);
        if a.q.cols != width
            || a.weights.cols != a.heads
            || a.weights.rows != t
            || !a.keys.have_cols(a.dim)
        {
            bail!(
                "indexer scores: queries of {} values, weights {}×{} and keys of other widths than {} for {t} queries of {} heads of {}",
                a.q.cols,
                a.weights.rows,
                a.weights.cols,
                a.dim,
                a.heads,
                a.dim
            );
        }
        let shared = ((width + a.heads) * std::mem::size_of::<f32>()) as u32;
        if shared > MAX_SCORES_BYTES {
            return Ok(None);
        }
        if t * total == 0 {
            return Ok(Some(Mat::new(t, total, vec![f32::NEG_INFINITY; t * total])));
        }
        let (q, keys) = (self.widened(a.q)?, self.widened_passes(a.keys)?);
        let weights = self.widened(a.weights)?;
        // Every query's score of every position (−∞ past its own).
        let mut out = self.alloc_written::<f32>(t * total)?;
        let (total32, heads, dim, start) = (
            to_u32(total)?,
            to_u32(a.heads)?,
            to_u32(a.dim)?,
            to_u32(a.start)?,
        );
        let f = self.kernel("indexer_scores", "f32")?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&*q.slice)
            .arg(&*keys.slice)
            .arg(&*weights.slice)
            .arg(&mut *out.slice)
            .arg(&total32)
            .arg(&heads)
            .arg(&dim)
            .arg(&start)
            .arg(&a.scale)
            .arg(&a.head_scale);
        let cfg = LaunchConfig {
            grid_dim: (total32.div_ceil(ROW_THREADS), to_u32(t)?, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: q holds t × heads × dim values, keys total × dim, weights t × heads (checked
        // above), out t × total; a query's values and weights take `shared` bytes.
        unsafe { launch.launch(cfg) }?;
        Ok(Some(self.output(t, total, out)?))
    }

    /// Every problem's `input · weightᵀ`, f32 accumulation, outputs in the dtype: the problems
    /// of fewer than [`ALONE_TOKENS`] tokens in one cuBLAS grouped GEMM (each problem a group of
    /// one, their operand addresses sent to the GPU in one copy), the others a GEMM each.
    fn grouped_gemm<D: Dtype>(&self, problems: &[GroupedGemm<'_, D>]) -> Result<()> {
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
struct GroupedGemm<'a, D: Dtype> {
    weight: &'a cudarc::driver::CudaSlice<D>,
    rows: usize,
    input: u64,
    t: usize,
    k: usize,
    out: u64,
}

/// One gated MLP of [`Device::mlps`]: its rows of the input (all of them where `None`),
/// `[gate, up, down]` on this GPU, and the gate's and down's rows.
pub(super) struct GpuMlp<'a, D: Dtype> {
    pub(super) rows: Option<&'a [usize]>,
    pub(super) weights: [&'a Buffer<D>; 3],
    pub(super) inner: usize,
    pub(super) out_rows: usize,
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
