//! The pipelines behind the commands, as a library: a recorded run, the one-shot bisect and
//! the gate's candidate, with typed inputs and reports. The command line only parses arguments
//! into these and prints what they return (docs/design.md §3).

pub mod bisect;
pub mod fault_matrix;
pub mod gate;
pub mod model;
pub mod record;
pub mod rendezvous;

pub use model::Model;
