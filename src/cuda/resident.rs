//! What a rank keeps on its GPU between uses, within a budget of the GPU's free memory: stored
//! weight blocks, and dequantized weights a run keeps for its later passes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::memory::Buffer;
use crate::exec::storage::claim::Claim;
use crate::exec::storage::stored::BlockKey;

/// Stored weight blocks kept on one GPU after their first use, up to a budget: a rank's shards
/// stay on its GPU as the file stores them (a quarter of bf16's bytes at Q4_K), and each use
/// only dequantizes them there. Blocks past the budget are uploaded for one use and freed.
pub(super) struct Resident {
    pub(super) blocks: HashMap<BlockKey, Buffer<u8>>,
    /// Bytes of blocks it may keep: the GPU's free memory at start, less a reserve for the
    /// dequantized weights and activations of the op running.
    pub(super) budget: u64,
    /// Bytes of the blocks kept.
    pub(super) kept: u64,
    /// Bytes of dequantized weights kept for a run's later passes (their claims give them
    /// back when the run drops them).
    pub(super) weights: Arc<AtomicU64>,
    /// The part of the budget that kept weights leave to blocks: the rank's share of the
    /// model's stored bytes, so that keeping a layer's dequantized weights never costs
    /// another layer's blocks a read from disk on each pass. Nothing is kept until a run
    /// says how large that share is.
    pub(super) for_blocks: u64,
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
            weights: Arc::default(),
            for_blocks: u64::MAX,
            loaded: 0,
            load_seconds: 0.0,
        }
    }

    /// Whether blocks of `bytes` fit beside what is kept.
    pub(super) fn room_for_blocks(&self, bytes: u64) -> bool {
        self.kept + self.weights.load(Ordering::Relaxed) + bytes <= self.budget
    }

    /// A claim on `bytes` for a dequantized weight kept for later passes, when they fit in
    /// the budget less the room left to blocks.
    pub(super) fn claim_weight(&self, bytes: u64) -> Option<Claim> {
        let cap = self.budget.saturating_sub(self.for_blocks.max(self.kept));
        Claim::reserve(&self.weights, bytes, cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn kept_weights_leave_the_blocks_their_share_of_the_budget() {
        // 20 GiB free of 40: a 4 GiB working reserve leaves a budget of 16.
        let mut r = Resident::new(20 * GIB, 40 * GIB);
        assert_eq!(r.budget, 16 * GIB);
        assert!(
            r.claim_weight(1).is_none(),
            "nothing kept before the blocks' share is known"
        );
        r.for_blocks = 10 * GIB;
        let six = r
            .claim_weight(6 * GIB)
            .expect("within the 6 GiB left to weights");
        assert!(r.claim_weight(1).is_none());
        assert!(r.room_for_blocks(10 * GIB) && !r.room_for_blocks(10 * GIB + 1));
        // Blocks past their share shrink what weights may take.
        r.kept = 12 * GIB;
        drop(six);
        assert_eq!(r.weights.load(Ordering::Relaxed), 0);
        assert!(r.claim_weight(4 * GIB + 1).is_none());
        let four = r.claim_weight(4 * GIB).expect("the 4 GiB the blocks leave");
        assert!(!r.room_for_blocks(1));
        drop(four);
        assert!(r.room_for_blocks(4 * GIB));
    }
}
