//! Traces (docs/design.md §5): a folder `NAME.trace/` holding `manifest.json` (the run and, for every
//! stage, its statistics) and safetensors files with the full tensors of the selected stages.
//! Anything that writes JSON and safetensors can produce one, so engine probes need no Rust.

pub mod error;
pub mod manifest;
pub mod reader;
pub mod select;
pub mod sglang;
pub mod stats;
pub mod writer;

pub use error::{Result, TraceError};
pub use manifest::{ElemType, Manifest, ModelInfo, StageRecord};
pub use reader::Trace;
pub use select::{FullSelector, DEFAULT_FULL};
pub use stats::TensorStats;
pub use writer::{OwnedStage, Stage, StageLater, TraceHeader, TraceWriter};

/// Whether `path` is a trace rather than a model: a folder holding `manifest.json`, or an
/// SGLang dump folder, read as one.
pub fn is_trace(path: &std::path::Path) -> bool {
    path.join(manifest::MANIFEST_NAME).is_file() || sglang::is_dump(path)
}
