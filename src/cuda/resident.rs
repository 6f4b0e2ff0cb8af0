//! The stored weight blocks a rank keeps on its GPU between uses, within a budget of the GPU's
//! free memory, and the page-locked buffer they go up through.

use std::collections::HashMap;

use anyhow::{Context, Result};
use cudarc::driver::PinnedHostSlice;

use super::memory::Buffer;
use super::Gpu;
use crate::exec::stored::BlockKey;

/// Stored weight blocks kept on one GPU after their first use, up to a budget: a rank's shards
/// stay on its GPU as the file stores them (a quarter of bf16's bytes at Q4_K), and each use
/// only dequantizes them there. Blocks past the budget are uploaded for one use and freed.
pub(super) struct Resident {
    /// Page-locked host memory blocks pass through on their way up: the DMA engine copies it
    /// at the link's speed, where pageable memory goes through the driver's own staging.
    staging: Option<PinnedHostSlice<u8>>,
    pub(super) blocks: HashMap<BlockKey, Buffer<u8>>,
    /// Bytes of blocks it may keep: the GPU's free memory at start, less a reserve for the
    /// dequantized weights and activations of the op running.
    pub(super) budget: u64,
    pub(super) kept: u64,
    /// Bytes read from the files and uploaded, and the seconds that took.
    pub(super) loaded: u64,
    pub(super) load_seconds: f64,
}

/// GPU memory left free for the working set of one op (dequantized weights, activations):
/// a tenth of the GPU, at least 4 GiB.
fn working_reserve(total: u64) -> u64 {
    (total / 10).max(4 << 30)
}

impl Resident {
    pub(super) fn new(free: u64, total: u64) -> Self {
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
    pub(super) fn staging(&mut self, gpu: &Gpu, bytes: usize) -> Result<&mut [u8]> {
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
