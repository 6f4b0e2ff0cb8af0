//! The stored weight blocks a rank keeps on its GPU between uses, within a budget of the GPU's
//! free memory.

use std::collections::HashMap;

use super::memory::Buffer;
use crate::exec::stored::BlockKey;

/// Stored weight blocks kept on one GPU after their first use, up to a budget: a rank's shards
/// stay on its GPU as the file stores them (a quarter of bf16's bytes at Q4_K), and each use
/// only dequantizes them there. Blocks past the budget are uploaded for one use and freed.
pub(super) struct Resident {
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
            blocks: HashMap::new(),
            budget: free.saturating_sub(working_reserve(total)),
            kept: 0,
            loaded: 0,
            load_seconds: 0.0,
        }
    }
}
