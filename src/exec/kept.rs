//! Weights a run keeps between its passes, as its backend holds them. A greedy generation or a
//! warm-up runs every layer and lm_head again, and dequantizing a weight again costs far more
//! than keeping it (GLM-5's lm_head alone is 3.8 GB of f32 decoded from Q6_K per pass).
//!
//! Bounded: each kept weight holds a [`Claim`] on the memory its backend keeps it in. Host
//! weights: all runs of the process together keep at most a byte budget (half the memory
//! available when the first run starts, or `GLMCHECK_KEEP_WEIGHTS_GIB`; 0 keeps nothing). A GPU
//! backend claims on the weight's GPU instead. First come, first kept; a weight past the budget
//! is dequantized for each use, as without keeping. Keeping never changes a value: a kept
//! weight is the one the first pass held.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};

use anyhow::{Context, Result};

use super::backend::Backend;
use crate::dtype::Precision;
use crate::model::names::WeightId;

/// Bytes of host memory kept by every run of this process.
static HOST_KEPT: LazyLock<Arc<AtomicU64>> = LazyLock::new(Arc::default);

/// The environment variable that sets the budget, in GiB.
pub const BUDGET_VARIABLE: &str = "GLMCHECK_KEEP_WEIGHTS_GIB";

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

/// Bytes a kept weight holds of a budget, given back when it is dropped with the weight.
pub struct Claim {
    bytes: u64,
    used: Arc<AtomicU64>,
}

impl Claim {
    /// `bytes` more counted on `used`, when the total stays within `budget`.
    pub fn reserve(used: &Arc<AtomicU64>, bytes: u64, budget: u64) -> Option<Claim> {
        used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |now| {
            now.checked_add(bytes).filter(|&total| total <= budget)
        })
        .ok()?;
        Some(Claim {
            bytes,
            used: used.clone(),
        })
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.used.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A claim on `bytes` of host memory against the process's budget, when they fit.
pub fn claim_host(bytes: u64) -> Result<Option<Claim>> {
    Ok(Claim::reserve(&HOST_KEPT, bytes, budget()?))
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
        let key = Key {
            part,
            holder: TypeId::of::<B::Weight>(),
            precision: be.precision(),
        };
        let found = lock(&self.held).get(&key).map(|(w, _)| w.clone());
        if let Some(w) = found.and_then(|w| w.downcast::<B::Weight>().ok()) {
            return Ok(w);
        }
        let w = Arc::new(hold()?);
        if let Some(claim) = be.claim_kept(&w)? {
            self.bytes.fetch_add(claim.bytes, Ordering::Relaxed);
            // Two threads holding the same part keep the later one; the earlier one's claim is
            // given back as it is replaced.
            if let Some((_, replaced)) = lock(&self.held).insert(key, (w.clone(), claim)) {
                self.bytes.fetch_sub(replaced.bytes, Ordering::Relaxed);
            }
        }
        Ok(w)
    }

    /// Bytes this run keeps.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The process's budget, read once.
fn budget() -> Result<u64> {
    static BUDGET: OnceLock<std::result::Result<u64, String>> = OnceLock::new();
    BUDGET
        .get_or_init(|| budget_from(std::env::var(BUDGET_VARIABLE).ok(), available_memory()))
        .clone()
        .map_err(anyhow::Error::msg)
}

/// `GLMCHECK_KEEP_WEIGHTS_GIB` when set, else half of `available` (0 where unknown).
fn budget_from(
    setting: Option<String>,
    available: Option<u64>,
) -> std::result::Result<u64, String> {
    match setting {
        Some(s) => s
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|g| g.is_finite() && *g >= 0.0)
            .map(|g| (g * (1u64 << 30) as f64) as u64)
            .with_context(|| format!("{BUDGET_VARIABLE}={s}: not a number of GiB (0 or more)"))
            .map_err(|e| format!("{e:#}")),
        None => Ok(available.unwrap_or(0) / 2),
    }
}

/// MemAvailable of /proc/meminfo, in bytes.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::backend::Cpu;
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
        let first = kept
            .get_or_hold(&be, part(0), || Ok(Mat::new(1, 2, vec![1.0, 2.0])))
            .unwrap();
        let again = kept
            .get_or_hold(&be, part(0), || -> Result<Mat<f32>> {
                panic!("held again")
            })
            .unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(kept.bytes(), 8);
        // Another precision is another weight.
        let bf16 = Cpu::new(Precision::Bf16);
        let other = kept
            .get_or_hold(&bf16, part(0), || Ok(Mat::new(1, 1, vec![3.0])))
            .unwrap();
        assert_eq!(other.data, vec![3.0]);
    }

    #[test]
    fn the_budget_is_read_from_the_environment_or_the_memory() {
        assert_eq!(budget_from(None, Some(10 << 30)), Ok(5 << 30));
        assert_eq!(budget_from(None, None), Ok(0));
        assert_eq!(budget_from(Some("1.5".into()), None), Ok(3 << 29));
        assert_eq!(budget_from(Some("0".into()), Some(1 << 40)), Ok(0));
        let err = budget_from(Some("lots".into()), None).unwrap_err();
        assert!(
            err.contains(BUDGET_VARIABLE) && err.contains("lots"),
            "{err}"
        );
    }

    #[test]
    fn nothing_is_kept_past_the_budget_and_a_dropped_claim_gives_its_bytes_back() {
        let used = Arc::new(AtomicU64::new(0));
        assert!(Claim::reserve(&used, 1, 0).is_none());
        let first = Claim::reserve(&used, 6, 10).expect("fits");
        assert!(Claim::reserve(&used, 5, 10).is_none());
        let second = Claim::reserve(&used, 4, 10).expect("fits");
        assert_eq!(used.load(Ordering::Relaxed), 10);
        drop(first);
        assert_eq!(used.load(Ordering::Relaxed), 4);
        assert!(Claim::reserve(&used, u64::MAX, u64::MAX).is_none());
        drop(second);
        assert_eq!(used.load(Ordering::Relaxed), 0);
    }
}
