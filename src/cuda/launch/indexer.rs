//! The DSA indexer's scores on the GPU, kept apart from the attention kernels as it has its own
//! kernel, shared-memory limit and fallback to the host.

use anyhow::{bail, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{to_u32, MAX_SCORES_BYTES, ROW_THREADS};
use crate::cuda::device::Device;
use crate::exec::mat::Mat;
use crate::exec::ops::indexer_core::IndexerInputs;

impl Device {
    /// The DSA indexer's scores (see [`IndexerInputs`]) in f32, in the CPU's order, one thread
    /// per query and key; `None` where a query's heads do not fit in a block's shared memory.
    pub(in crate::cuda) fn indexer_scores(
        &self,
        a: &IndexerInputs<'_, f32>,
    ) -> Result<Option<Mat<f32>>> {
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
}
