//! Comparing traces (docs/design.md §6–§7): metrics per stage, unsharding of tensor-parallel parts,
//! logits statistics, the first divergence and its fault class.

pub mod classify;
pub mod diff;
pub mod fault;
pub mod logits;
pub mod metrics;
pub mod parts;
pub mod server_drift;
pub mod softmax_fit;
pub mod stage_diff;
pub mod sum_fit;
pub mod top_k;
pub mod unshard;

pub use diff::{diff, DiffOptions, DiffReport, Partial};
pub use fault::{Fault, FaultClass};
pub use stage_diff::{StageDiff, Status};
