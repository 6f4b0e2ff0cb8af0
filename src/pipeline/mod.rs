//! The pipelines behind the commands, as a library: a recorded run, the one-shot bisect, the
//! gate's candidate, a checkpoint's inspection, dequantization and tensor-parallel plan, and the
//! backend's self-test, with typed inputs and reports. The command line only parses arguments
//! into these and prints what they return (docs/design.md §3).

pub mod bisect;
pub mod dequant;
pub mod endpoint;
pub mod fault_matrix;
pub mod gate;
pub mod inspect;
pub mod logits;
pub mod model;
pub mod record;
pub mod rendezvous;
pub mod selftest;
pub mod shards;

pub use model::Model;
