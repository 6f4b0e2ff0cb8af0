//! Weights a run keeps between its passes, as its backend holds them. A greedy generation or a
//! warm-up runs every layer and lm_head again, and reading a weight again (from a disk, for a
//! model larger than the page cache) or dequantizing it again on a GPU costs more than keeping
//! it: the CPU keeps a quantized weight's blocks, a GPU its dequantized values.
//!
//! Bounded: each kept weight holds a [`Claim`] on the memory its backend keeps it in (see
//! [`crate::exec::storage::claim`]). First come, first kept; a weight past the budget is read again for each
//! use, as without keeping. Keeping never changes a value: a kept weight is the one the first
//! pass held.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Result;

use crate::dtype::Precision;
use crate::exec::backend::Backend;
use crate::exec::storage::claim::Claim;
use crate::model::names::WeightId;

/// Which part of a weight: its id, the rows a slice of it covers, the rank's shard (rank, TP,
/// EP).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Part {
    pub id: WeightId,
    pub rows: Option<(u64, u64)>,
    pub shard: Option<(usize, usize, bool)>,
}

/// A part as one holder holds it: its weight type and precision.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    part: Part,
    holder: TypeId,
    precision: Precision,
}

impl Key {
    /// `part` as `be` holds it.
    fn of<B: Backend>(be: &B, part: Part) -> Key {
        Key {
            part,
            holder: TypeId::of::<B::Weight>(),
            precision: be.precision(),
        }
    }
}

/// A kept weight and the claim on the memory that holds it (dropped after the weight).
type Kept = (Arc<dyn Any + Send + Sync>, Claim);

/// The weights one run keeps.
#[derive(Default)]
pub struct KeptWeights {
    held: Mutex<HashMap<Key, Kept>>,
    bytes: AtomicU64,
}

impl KeptWeights {
    /// `part` as `be` holds it: kept from an earlier call, or made by `hold` and kept when the
    /// budget allows.
    pub fn get_or_hold<B: Backend>(
        &self,
        be: &B,
        part: Part,
        hold: impl FnOnce() -> Result<B::Weight>,
    ) -> Result<Arc<B::Weight>> {
        let key = Key::of(be, part);
        let found = lock(&self.held).get(&key).map(|(w, _)| w.clone());
        if let Some(w) = found.and_then(|w| w.downcast::<B::Weight>().ok()) {
            return Ok(w);
        }
        let w = Arc::new(hold()?);
        if let Some(claim) = be.claim_kept(&w)? {
            self.bytes.fetch_add(claim.bytes(), Ordering::Relaxed);
            // Two threads holding the same part keep the later one; the earlier one's claim is
            // given back as it is replaced.
            if let Some((_, replaced)) = lock(&self.held).insert(key, (w.clone(), claim)) {
                self.bytes.fetch_sub(replaced.bytes(), Ordering::Relaxed);
            }
        }
        Ok(w)
    }

    /// Whether `part` is kept as `be` holds it.
    pub fn has<B: Backend>(&self, be: &B, part: Part) -> bool {
        lock(&self.held).contains_key(&Key::of(be, part))
    }

    /// Bytes this run keeps.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::backend::Cpu;
    use crate::exec::cpu::host_weight::HostWeight;
    use crate::exec::mat::Mat;
    use crate::model::names::LayerWeight;

    fn part(l: u64) -> Part {
        Part {
            id: WeightId::Layer(l, LayerWeight::QA),
            rows: None,
            shard: None,
        }
    }

    #[test]
    fn a_kept_weight_is_the_first_one_held() {
        let kept = KeptWeights::default();
        let be = Cpu::new(Precision::F32);
        assert!(!kept.has(&be, part(0)));
        let first = kept
            .get_or_hold(&be, part(0), || be.hold(Mat::new(1, 2, vec![1.0, 2.0])))
            .unwrap();
        let again = kept
            .get_or_hold(&be, part(0), || -> Result<HostWeight<f32>> {
                panic!("held again")
            })
            .unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(kept.bytes(), 8);
        assert!(kept.has(&be, part(0)) && !kept.has(&be, part(1)));
        // Another precision is another weight.
        let bf16 = Cpu::new(Precision::Bf16);
        assert!(!kept.has(&bf16, part(0)));
        let other = kept
            .get_or_hold(&bf16, part(0), || bf16.hold(Mat::new(1, 1, vec![3.0])))
            .unwrap();
        let HostWeight::Values(other) = &*other else {
            panic!("values held as blocks");
        };
        assert_eq!(other.data(), [3.0]);
    }
}
