//! The row and element-wise kernels of `kernels/ops.cu`: norms, element-wise ops of two
//! matrices, kv_b's assembly, RoPE and cutting columns out of heads. Each reads its input values
//! and writes new ones of the same rows, with nothing summed across rows.

use anyhow::{bail, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{check_len, elements, to_u32, ROW_THREADS};
use crate::cuda::device::Device;
use crate::cuda::dtype::Dtype;
use crate::cuda::memory::Buffer;
use crate::exec::backend::HeadCut;
use crate::exec::mat::Mat;
use crate::exec::ops::rope::{Rope, RotateSpec};
use crate::model::kv_b::KvBDims;

impl Device {
    /// RMSNorm (no bias) or LayerNorm (`bias` Some) of every row of `x`.
    pub(in crate::cuda) fn norm<D: Dtype>(
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
    pub(in crate::cuda) fn elementwise<D: Dtype>(
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
    pub(super) fn elementwise_here<D: Dtype>(
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
    pub(in crate::cuda) fn assemble_kv_b<D: Dtype>(
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
    pub(in crate::cuda) fn rope(
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
    pub(in crate::cuda) fn head_columns<D: Dtype>(
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
}
