//! The pipelines behind the commands, as a library: a recorded run and the one-shot bisect,
//! with typed inputs and reports. The command line only parses arguments into these and prints
//! what they return (docs/design.md §3).

pub mod bisect;
pub mod model;
pub mod record;

pub use model::Model;
