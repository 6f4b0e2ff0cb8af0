//! Claims on memory budgets: what a weight kept between a run's passes holds of the memory
//! that keeps it. Host weights: all runs of the process together keep at most a byte budget
//! (half the memory available when the first run starts, or `GLMCHECK_KEEP_WEIGHTS_GIB`; 0 keeps
//! nothing). A GPU backend claims on the weight's GPU instead, against its own budget.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};

use anyhow::{Context, Result};

/// Bytes of host memory kept by every run of this process.
static HOST_KEPT: LazyLock<Arc<AtomicU64>> = LazyLock::new(Arc::default);

/// The environment variable that sets the budget, in GiB.
pub const BUDGET_VARIABLE: &str = "GLMCHECK_KEEP_WEIGHTS_GIB";

/// Bytes a kept weight holds of a budget, given back when it is dropped with the weight.
pub struct Claim {
    bytes: u64,
    used: Arc<AtomicU64>,
}

impl Claim {
    /// Bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

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
