//! glmcheck: finds why a large language model prints garbage.
//!
//! The library holds everything the `glmcheck` binary does; `main.rs` only maps outcomes to exit
//! codes, and [`cli`] only parses arguments into the pipelines' options and prints their
//! reports. Another tool embeds a diagnosis through [`pipeline::bisect`]: here a tiny synthetic
//! GLM-5 is run at TP 4 with `kv_b_proj` loaded whole on every rank, and bisect names the
//! stage that first reads it and the fault's class.
//!
//! ```
//! use glmcheck::compare::FaultClass;
//! use glmcheck::exec::faults::inject::Injection;
//! use glmcheck::model::names::LayerWeight;
//! use glmcheck::pipeline::bisect::{bisect, BisectOptions, Candidate, RunAs};
//! use glmcheck::synth::{Preset, SynthSpec};
//!
//! # fn main() -> anyhow::Result<()> {
//! let dir = tempfile::tempdir()?;
//! let model = dir.path().join("tiny.gguf");
//! SynthSpec::new(Preset::Tiny.config(), 5).write_gguf(&model)?;
//!
//! let report = bisect(&BisectOptions {
//!     candidate: Candidate::Run(RunAs {
//!         tp: 4,
//!         inject: Some(Injection::UnshardedColumn(LayerWeight::KvB)),
//!         ..RunAs::default()
//!     }),
//!     tokens: vec![39, 100, 7, 200],
//!     generate: 0,
//!     ..BisectOptions::new(model)
//! })?;
//!
//! let divergence = report.diff.first_divergence.as_ref().expect("a divergence");
//! assert_eq!(divergence.stage, "L0.attn.kv");
//! let fault = report.diff.fault.as_ref().expect("a named fault");
//! assert_eq!(fault.class, FaultClass::UnshardedWeight);
//! # Ok(())
//! # }
//! ```

pub mod any_backend;
pub mod cli;
pub mod compare;
pub mod cuda;
pub mod diagnose;
pub mod dtype;
pub mod endpoint;
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
