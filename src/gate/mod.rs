//! `glmcheck gate`: a candidate run held to a reviewed baseline in CI.
//!
//! [`baseline`] is the file (statistics per stage record, per-position logits, the run's
//! settings, the limits' rule), [`check()`] judges a candidate trace against it; the verdict's
//! renderings (terminal, JUnit, Markdown) are in `report::gate`.

pub mod baseline;
pub mod check;

pub use baseline::{Baseline, Limits};
pub use check::{check, check_config, GateReport, StageResult};
