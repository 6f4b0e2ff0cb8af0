//! The routed experts' weighted sum, and the rounding of a sum to the dtype, on the GPU that
//! holds the experts' outputs: where one GPU runs the forward, a MoE layer's outputs (eight rows
//! a token at GLM-5's top-8) are never fetched to be added on the host.

use anyhow::Result;
use cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};

use super::device::Device;
use super::dtype::Dtype;
use super::launch::{elements, to_u32, ROW_THREADS};
use crate::exec::backend::WeightedRows;
use crate::exec::mat::Mat;

impl Device {
    /// `sum` (zeros where `None`) plus each output's rows times their routing weights, each
    /// token's outputs in order (`expert_sum` of `kernels/ops.cu`), left here in f32; `None`
    /// where this GPU does not run alone, `sum` is not held here in f32 or an output is not
    /// held here in `D` (a planted NaN changed it on the host): the host adds those.
    pub(super) fn add_weighted<D: Dtype>(
        &self,
        sum: Option<&Mat<f32>>,
        (rows, cols): (usize, usize),
        outputs: &[WeightedRows<'_, f32>],
    ) -> Result<Option<Mat<f32>>> {
        if !self.lazy_outputs || rows == 0 || cols == 0 {
            return Ok(None);
        }
        let sum_here = match sum {
            Some(m) if (m.rows, m.cols) == (rows, cols) => match self.twin_here::<f32>(m) {
                Some(buf) => Some(buf),
                None => return Ok(None),
            },
            Some(_) => return Ok(None),
            None => None,
        };
        let mut held = Vec::with_capacity(outputs.len());
        for (chosen, y) in outputs {
            match self.twin_here::<D>(y) {
                Some(buf) if y.cols == cols && y.rows == chosen.len() => held.push(buf),
                _ => return Ok(None),
            }
        }
        let stream = &self.gpu.stream;
        // Per token, the address of each output row it chose and its weight, in order.
        let mut per_token: Vec<Vec<(u64, f32)>> = vec![Vec::new(); rows];
        let mut guards = Vec::with_capacity(held.len());
        for ((chosen, _), buf) in outputs.iter().zip(&held) {
            let (base, guard) = buf.slice.device_ptr(stream);
            guards.push(guard);
            for (r, &(token, w)) in chosen.iter().enumerate() {
                let Some(slot) = per_token.get_mut(token) else {
                    anyhow::bail!("expert sum: token {token} of {rows}");
                };
                slot.push((base + (r * cols * size_of::<D>()) as u64, w));
            }
        }
        let mut starts = Vec::with_capacity(rows + 1);
        let (mut addresses, mut weights) = (Vec::new(), Vec::new());
        for chosen in &per_token {
            starts.push(to_u32(addresses.len())?);
            for &(address, w) in chosen {
                addresses.push(address);
                weights.push(w);
            }
        }
        starts.push(to_u32(addresses.len())?);
        let (starts, addresses, weights) = (
            self.upload_exact(&starts)?,
            self.upload_exact(&addresses)?,
            self.upload_exact(&weights)?,
        );
        let mut out = self.alloc_written::<f32>(rows * cols)?;
        let (has_sum, cols32) = (u32::from(sum_here.is_some()), to_u32(cols)?);
        let f = self.kernel("expert_sum", D::SUFFIX)?;
        let mut launch = stream.launch_builder(&f);
        // Without a sum the kernel reads none: the output stands in for the pointer.
        let (out_ptr, out_guard) = out.slice.device_ptr(stream);
        let sum_ptr = match sum_here {
            Some(buf) => buf.slice.device_ptr(stream).0,
            None => out_ptr,
        };
        drop(out_guard);
        launch
            .arg(&sum_ptr)
            .arg(&has_sum)
            .arg(&*addresses.slice)
            .arg(&*weights.slice)
            .arg(&*starts.slice)
            .arg(&mut *out.slice)
            .arg(&cols32);
        let cfg = LaunchConfig {
            grid_dim: (to_u32(rows)?, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `sum` (where read) and `out` hold rows × cols f32 values; every address is a
        // row of `cols` values inside an output held here (its rows checked above), alive until
        // the kernel is done (the buffers are freed in stream order); `starts` holds rows + 1
        // offsets into `addresses` and `weights`.
        unsafe { launch.launch(cfg) }?;
        drop(guards);
        self.output(rows, cols, out).map(Some)
    }

    /// `m` rounded to `D` here, where `m` is held here in f32 and this GPU runs alone; `None`
    /// otherwise (the host rounds it).
    pub(super) fn rounded<D: Dtype>(&self, m: &Mat<f32>) -> Result<Option<Mat<f32>>> {
        let n = m.len();
        let Some(x) = self
            .twin_here::<f32>(m)
            .filter(|_| self.lazy_outputs && n > 0)
        else {
            return Ok(None);
        };
        let mut out = self.alloc_written::<D>(n)?;
        let count = to_u32(n)?;
        let f = self.kernel("round_to", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch.arg(&*x.slice).arg(&mut *out.slice).arg(&count);
        // SAFETY: `x` holds at least `n` values (its twin's length), `out` `n`.
        unsafe { launch.launch(elements(count)) }?;
        self.output(m.rows, m.cols, out).map(Some)
    }
}
