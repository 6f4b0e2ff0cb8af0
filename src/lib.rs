//! glmcheck: finds why a large language model prints garbage.
//!
//! The library holds everything the `glmcheck` binary does; `main.rs` only maps outcomes to exit
//! codes.

pub mod cli;
pub mod compare;
pub mod cuda;
pub mod diagnose;
pub mod dtype;
pub mod engine;
pub mod exec;
pub mod gate;
pub mod model;
pub mod pipeline;
pub mod progress;
pub mod report;
pub mod rng;
pub mod shard;
pub mod synth;
pub mod trace;
pub mod verify;
pub mod weights;
