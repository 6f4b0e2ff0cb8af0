//! `glmcheck gate`: a candidate run held to a reviewed baseline in CI.
//!
//! [`baseline`] is the file (statistics per stage record, per-position logits, the run's
//! settings, the limits' rule), [`check()`] judges a candidate trace against it, [`junit`] and
//! [`markdown`] render the verdict for CI systems and job summaries.

pub mod baseline;
pub mod check;
pub mod junit;
pub mod markdown;

pub use baseline::{Baseline, Limits};
pub use check::{check, check_config, GateReport, StageResult};
