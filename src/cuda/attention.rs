//! MLA attention on one rank's GPU. A batch of positions is three strided batched GEMMs through
//! cuBLAS (scores from the no-RoPE and the RoPE dims, then the weighted values) around one
//! softmax kernel that masks each query's scores to the keys it sees (`attention_softmax` in
//! `kernels/ops.cu`): every head's scores at once, in f32, chunked so that they take at most
//! [`score_mib`]. Where the cache holds a NaN or an infinity, one block per position and head
//! (`attention`) writes the context again: the CPU skips keys a query does not see, a product
//! by zero would not (0 · NaN is NaN), and a fault at a later position must not reach earlier
//! ones. A flag on the GPU makes that choice, which the host does not wait for.

use std::sync::OnceLock;

use anyhow::{anyhow, bail, Result};
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use rayon::prelude::*;

use super::device::Device;
use super::dtype::Dtype;
use super::launch::{elements, to_i32, to_u32, MAX_SCORES_BYTES, ROW_THREADS};
use super::memory::Buffer;
use crate::exec::mat::Mat;
use crate::exec::ops::attention_core::AttentionInputs;

/// MiB the scores of one chunk of queries may take by default: GLM-5's 64 heads at 4096
/// positions are 256 Ki scores (1 MiB) a query.
const SCORE_MIB: usize = 256;

/// MiB the scores of one chunk of queries may take: `GLMCHECK_ATTENTION_MIB` where set to a
/// number (0 gives chunks of one query, which `scripts/gpu/gpu-backend-check` runs the selftest
/// with), else [`SCORE_MIB`].
fn score_mib() -> usize {
    static MIB: OnceLock<usize> = OnceLock::new();
    *MIB.get_or_init(|| match std::env::var("GLMCHECK_ATTENTION_MIB") {
        Ok(v) => v.parse().unwrap_or_else(|_| {
            eprintln!(
                "glmcheck: GLMCHECK_ATTENTION_MIB={v:?} is not a number of MiB; using {SCORE_MIB}"
            );
            SCORE_MIB
        }),
        Err(_) => SCORE_MIB,
    })
}

/// Queries per chunk: as many as `mib` MiB of f32 scores hold, at least one.
fn queries_per_chunk(t: usize, heads: usize, positions: usize, mib: usize) -> usize {
    let per_query = (heads * positions * size_of::<f32>()).max(1);
    ((mib << 20) / per_query).clamp(1, t.max(1))
}

/// One operand of a strided batched GEMM as cuBLAS reads it (column-major): its first value's
/// address, its leading dimension and the step from one batch's matrix to the next, in values.
#[derive(Clone, Copy)]
struct Operand {
    ptr: u64,
    ld: usize,
    stride: usize,
}

impl Operand {
    /// The same operand `values` further on.
    fn at(self, values: usize) -> Operand {
        Operand {
            ptr: self.ptr + (values * size_of::<f32>()) as u64,
            ..self
        }
    }
}

impl Device {
    /// MLA attention (see [`AttentionInputs`]), the context `[t, heads · v]` in f32, left here
    /// for the rounding that follows.
    pub(super) fn attention<D: Dtype>(&self, a: &AttentionInputs<'_, f32>) -> Result<Mat<f32>> {
        let (t, heads, positions) = (a.q.rows, a.heads, a.positions);
        let (qk, stride) = (a.nope + a.rope, heads * (a.nope + a.v));
        let n = t * heads * a.v;
        if n == 0 {
            return Ok(Mat::zeros(t, heads * a.v));
        }
        if a.q.cols != heads * qk
            || !a.kv.have_cols(stride)
            || a.kv.positions() != positions
            || !a.k_rope.have_cols(a.rope)
            || a.k_rope.positions() != positions
            || a.keys.len() != t
        {
            bail!(
                "attention: {t} queries of {} values, {} kv rows, {} RoPE key rows, {} key lists, for {heads} heads of {} + {} and {positions} positions",
                a.q.cols,
                a.kv.positions(),
                a.k_rope.positions(),
                a.keys.len(),
                a.nope,
                a.rope
            );
        }
        let beyond = |row: &Vec<i32>| {
            row.iter()
                .copied()
                .find(|&j| j >= 0 && j as usize >= positions)
        };
        if let Some(j) = a.keys.par_iter().find_map_any(beyond) {
            bail!("attention: key {j} beyond the {positions} cached positions");
        }
        let q = self.input::<D>(a.q)?;
        // A prompt's cache is its own projections' outputs, read where they were left.
        let (kv, k_rope) = (
            self.passes_input::<D>(a.kv)?,
            self.passes_input::<D>(a.k_rope)?,
        );
        let wide_kv = self.widen_here(&kv, positions * stride)?;
        let (wide_q, wide_k_rope) = (
            self.widen_here(&q, t * heads * qk)?,
            self.widen_maybe_empty(&k_rope, positions * a.rope)?,
        );
        let mask = KeyMask::of(a.keys, positions);
        let mask_buf = self.upload_exact(&mask.bits)?;
        let mut out = self.attention_by_gemms(a, &wide_q, &wide_kv, &wide_k_rope, &mask_buf)?;
        // Where the cache holds a NaN or an infinity, the per-position kernel writes the
        // context again: the GPU reads the flag itself, so the host never waits for it.
        let nonfinite = self.any_nonfinite(&wide_kv, positions * stride)?;
        let inputs = [&*q, &*kv, &*k_rope];
        self.attention_by_position(a, inputs, (&mask, &mask_buf), &nonfinite, &mut out)?;
        self.output(t, heads * a.v, out)
    }

    /// The context through cuBLAS, queries in chunks: per chunk every head's scores (the
    /// no-RoPE products, then the RoPE products added), `attention_softmax` in place, and the
    /// weights times the values into the chunk's rows of the context.
    fn attention_by_gemms(
        &self,
        a: &AttentionInputs<'_, f32>,
        q: &Buffer<f32>,
        kv: &Buffer<f32>,
        k_rope: &Buffer<f32>,
        mask: &Buffer<u32>,
    ) -> Result<Buffer<f32>> {
        let (t, heads, positions) = (a.q.rows, a.heads, a.positions);
        let (qk, stride) = (a.nope + a.rope, heads * (a.nope + a.v));
        let words = mask_words(positions);
        let mut out = self.alloc_written::<f32>(t * heads * a.v)?;
        let chunk = queries_per_chunk(t, heads, positions, score_mib());
        // The guards of the buffers' addresses end before `out` is handed back.
        {
            let stream = &self.gpu.stream;
            let (q_ptr, _q) = q.slice.device_ptr(stream);
            let (kv_ptr, _kv) = kv.slice.device_ptr(stream);
            let (kr_ptr, _kr) = k_rope.slice.device_ptr(stream);
            let (out_ptr, _out) = out.slice.device_ptr_mut(stream);
            let queries = Operand {
                ptr: q_ptr,
                ld: heads * qk,
                stride: qk,
            };
            let keys = Operand {
                ptr: kv_ptr,
                ld: stride,
                stride: a.nope + a.v,
            };
            let rope_keys = Operand {
                ptr: kr_ptr,
                ld: a.rope.max(1),
                stride: 0,
            };
            let context = Operand {
                ptr: out_ptr,
                ld: heads * a.v,
                stride: a.v,
            };
            let softmax = self.gpu.ops_kernel("attention_softmax")?;
            for first in (0..t).step_by(chunk) {
                let rows = chunk.min(t - first);
                let (rows32, heads32) = (to_u32(rows)?, to_u32(heads)?);
                let mut scores = if qk == 0 {
                    self.alloc::<f32>(heads * rows * positions)?
                } else {
                    self.alloc_written::<f32>(heads * rows * positions)?
                };
                let (scores_ptr, _s) = scores.slice.device_ptr_mut(stream);
                let scores_op = Operand {
                    ptr: scores_ptr,
                    ld: positions,
                    stride: rows * positions,
                };
                let queries = queries.at(first * heads * qk);
                // Scores, per head `[positions, rows]` column-major: the keys' rows times the
                // queries'. The RoPE products are added to the no-RoPE ones (beta 1), as the CPU
                // adds the two dot products.
                let mut beta = 0.0;
                for (dims, keys, queries) in [
                    (a.nope, keys, queries),
                    (a.rope, rope_keys, queries.at(a.nope)),
                ] {
                    if dims > 0 {
                        let shape = (positions, rows, dims);
                        self.gemm_batched(true, shape, [keys, queries, scores_op], beta, heads)?;
                        beta = 1.0;
                    }
                }
                let (positions32, words32) = (to_u32(positions)?, to_u32(words)?);
                let mask_rows = mask.slice.slice(first * words..);
                let mut launch = stream.launch_builder(&softmax);
                launch
                    .arg(&scores_ptr)
                    .arg(&mask_rows)
                    .arg(&rows32)
                    .arg(&positions32)
                    .arg(&words32)
                    .arg(&a.scale);
                let cfg = LaunchConfig {
                    grid_dim: (rows32, heads32, 1),
                    block_dim: (ROW_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: `scores` holds heads × rows × positions values and the mask a row of
                // `words` words for each of the chunk's queries.
                unsafe { launch.launch(cfg) }?;
                // Context, per head `[v, rows]` column-major: the values' rows times the weights.
                let values = keys.at(a.nope);
                let shape = (a.v, rows, positions);
                let context = context.at(first * heads * a.v);
                self.gemm_batched(false, shape, [values, scores_op, context], 0.0, heads)?;
            }
        }
        Ok(out)
    }

    /// Where `nonfinite` is set on the GPU, the context `out` again with one block per position
    /// and head (`attention` of `kernels/ops.cu`), each skipping the keys its position does not
    /// see, as the CPU does; its keys listed from the mask there (`mask_keys`), in ascending
    /// order as the CPU visits them. Where it is not, both kernels return at once.
    fn attention_by_position<D: Dtype>(
        &self,
        a: &AttentionInputs<'_, f32>,
        [q, kv, k_rope]: [&Buffer<D>; 3],
        (mask, mask_buf): (&KeyMask, &Buffer<u32>),
        nonfinite: &Buffer<u32>,
        out: &mut Buffer<f32>,
    ) -> Result<()> {
        let (t, heads) = (a.q.rows, a.heads);
        let slots = mask.most_seen.max(1);
        // The scores, then the query head.
        let shared = ((slots + a.nope + a.rope) * std::mem::size_of::<f32>()) as u32;
        if shared > MAX_SCORES_BYTES {
            // Too many keys for one block: only a cache that needs the kernel is an error,
            // which here the host must read the flag to tell.
            if self.gpu.stream.clone_dtoh(&*nonfinite.slice)?[0] != 0 {
                bail!(
                    "attention over {slots} keys of a cache holding a NaN or an infinity, with query heads of {}: at most {} values in one block",
                    a.nope + a.rope,
                    MAX_SCORES_BYTES / 4
                );
            }
            return Ok(());
        }
        let (heads32, nope, rope) = (to_u32(heads)?, to_u32(a.nope)?, to_u32(a.rope)?);
        let (v, slots32, t32) = (to_u32(a.v)?, to_u32(slots)?, to_u32(t)?);
        let mut key_buf = self.alloc_written::<i32>(t * slots)?;
        let words32 = to_u32(mask_words(a.positions))?;
        let listing = self.gpu.ops_kernel("mask_keys")?;
        let mut launch = self.gpu.stream.launch_builder(&listing);
        launch
            .arg(&*nonfinite.slice)
            .arg(&*mask_buf.slice)
            .arg(&mut *key_buf.slice)
            .arg(&t32)
            .arg(&words32)
            .arg(&slots32);
        // SAFETY: the mask holds a row of `words` words per query, the key buffer t × slots.
        unsafe { launch.launch(elements(t32)) }?;
        let f = self.kernel("attention", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch
            .arg(&*nonfinite.slice)
            .arg(&*q.slice)
            .arg(&*kv.slice)
            .arg(&*k_rope.slice)
            .arg(&*key_buf.slice)
            .arg(&mut *out.slice)
            .arg(&heads32)
            .arg(&nope)
            .arg(&rope)
            .arg(&v)
            .arg(&slots32)
            .arg(&a.scale);
        let cfg = LaunchConfig {
            grid_dim: (t32, heads32, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: q holds t × heads × (nope + rope) values, kv and k_rope every cached
        // position the mask sees (checked by the caller), keys t × slots, out t × heads × v;
        // the scores take `shared` bytes.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// A flag on the GPU, set where any of the first `n` values of `x` is NaN or infinite.
    fn any_nonfinite(&self, x: &Buffer<f32>, n: usize) -> Result<Buffer<u32>> {
        let mut flag = self.alloc::<u32>(1)?;
        if n == 0 {
            return Ok(flag);
        }
        let count = to_u32(n)?;
        let f = self.gpu.ops_kernel("any_nonfinite_f32")?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch.arg(&*x.slice).arg(&count).arg(&mut *flag.slice);
        // SAFETY: `x` holds at least `n` values, the flag one.
        unsafe { launch.launch(elements(count)) }?;
        Ok(flag)
    }

    /// [`Self::widen_here`], an empty buffer for no values.
    fn widen_maybe_empty<D: Dtype>(&self, x: &Buffer<D>, n: usize) -> Result<Buffer<f32>> {
        if n == 0 {
            return self.alloc::<f32>(0);
        }
        self.widen_here(x, n)
    }

    /// `C_b = op(A_b) · B_b + beta · C_b` for each of `batch` matrices, f32 throughout with
    /// f32 accumulation; `op` transposes `A` where `transpose_a`; `(m, n, k)` are those of
    /// `C: m × n` and the product's inner dimension.
    fn gemm_batched(
        &self,
        transpose_a: bool,
        (m, n, k): (usize, usize, usize),
        [a, b, c]: [Operand; 3],
        beta: f32,
        batch: usize,
    ) -> Result<()> {
        let alpha = 1.0f32;
        let op_a = if transpose_a {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        };
        let f32_type = cudaDataType::CUDA_R_32F;
        let long =
            |v: usize| i64::try_from(v).map_err(|_| anyhow!("{v} is past cuBLAS's stride limit"));
        // SAFETY: every operand points into a live buffer holding its `batch` matrices at the
        // leading dimensions and strides given (the callers' layouts); alpha and beta are f32
        // as CUBLAS_COMPUTE_32F needs.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op_a,
                cublasOperation_t::CUBLAS_OP_N,
                to_i32(m)?,
                to_i32(n)?,
                to_i32(k)?,
                (&alpha) as *const f32 as *const _,
                a.ptr as *const _,
                f32_type,
                to_i32(a.ld)?,
                long(a.stride)?,
                b.ptr as *const _,
                f32_type,
                to_i32(b.ld)?,
                long(b.stride)?,
                (&beta) as *const f32 as *const _,
                c.ptr as *mut _,
                f32_type,
                to_i32(c.ld)?,
                long(c.stride)?,
                to_i32(batch)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| {
            anyhow!(
                "cuBLAS batched GEMM {m}×{n}×{k} ×{batch} on {}: {e:?}",
                self.gpu.name
            )
        })
    }
}

/// The words of a query's row of a [`KeyMask`]: `⌈positions / 32⌉`, at least one.
fn mask_words(positions: usize) -> usize {
    positions.div_ceil(32).max(1)
}

/// The keys each query sees, as the GPU reads them.
struct KeyMask {
    /// A bit per cached position for each query, set where the query sees it (its `keys`; −1
    /// is no key), [`mask_words`] words a query.
    bits: Vec<u32>,
    /// The most keys any query sees.
    most_seen: usize,
}

impl KeyMask {
    fn of(keys: &[Vec<i32>], positions: usize) -> KeyMask {
        let words = mask_words(positions);
        let mut bits = vec![0u32; keys.len() * words];
        let most_seen = bits
            .par_chunks_mut(words)
            .zip(keys)
            .map(|(row, chosen)| {
                for &j in chosen.iter().filter(|&&j| j >= 0) {
                    let j = j as usize;
                    row[j / 32] |= 1 << (j % 32);
                }
                row.iter().map(|w| w.count_ones() as usize).sum::<usize>()
            })
            .max()
            .unwrap_or(0);
        KeyMask { bits, most_seen }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_what_the_budget_allows_and_at_least_one_query() {
        // 64 heads at 4096 positions: 1 MiB a query.
        assert_eq!(queries_per_chunk(512, 64, 4096, 256), 256);
        assert_eq!(queries_per_chunk(37, 64, 4096, 256), 37);
        assert_eq!(queries_per_chunk(37, 3, 45, 0), 1);
        assert_eq!(queries_per_chunk(5, 64, 1 << 20, 1), 1);
    }

    #[test]
    fn the_mask_sets_each_seen_key_once() {
        let keys = vec![vec![0, 33, -1, 33], vec![], vec![31, 32, 40]];
        let mask = KeyMask::of(&keys, 41);
        assert_eq!(mask_words(41), 2);
        assert_eq!(mask.bits, vec![1, 1 << 1, 0, 0, 1 << 31, 1 | 1 << 8]);
        assert_eq!(mask.most_seen, 3);
    }
}
