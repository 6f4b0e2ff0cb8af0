//! Values as f32 on the GPU for the ops that compute in f32: a twin already here widened by a
//! kernel rather than fetched and sent back, else the host's values uploaded.

use anyhow::Result;
use cudarc::driver::PushKernelArg;
use half::{bf16, f16};

use super::{elements, to_u32};
use crate::cuda::device::Device;
use crate::cuda::dtype::Dtype;
use crate::cuda::memory::Buffer;
use crate::exec::mat::Mat;
use crate::exec::passes::Passes;

impl Device {
    /// `m` as f32 on this GPU, for an op that computes in f32 and writes its input: its twin
    /// here widened by a kernel (a query left here by its projection is not fetched, widened
    /// and sent back), else its values uploaded.
    pub(super) fn widened(&self, m: &Mat<f32>) -> Result<Buffer<f32>> {
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
    pub(super) fn widened_passes(&self, passes: Passes<'_, f32>) -> Result<Buffer<f32>> {
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
    pub(in crate::cuda) fn widen_here<D: Dtype>(
        &self,
        x: &Buffer<D>,
        n: usize,
    ) -> Result<Buffer<f32>> {
        let mut out = self.alloc_written::<f32>(n)?;
        let count = to_u32(n)?;
        let f = self.kernel("widen", D::SUFFIX)?;
        let mut launch = self.gpu.stream.launch_builder(&f);
        launch.arg(&*x.slice).arg(&mut *out.slice).arg(&count);
        // SAFETY: `x` holds at least `n` values (its twin's length), `out` `n`.
        unsafe { launch.launch(elements(count)) }?;
        Ok(out)
    }
}
