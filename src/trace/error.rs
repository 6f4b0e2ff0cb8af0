//! The one error type of traces: every variant names the trace (or file) and what in it is wrong.

use std::path::PathBuf;

use crate::weights::WeightError;

/// A trace could not be written or read, or holds something it must not.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The I/O error is in the message, not a source: an error chain would print it twice.
    #[error("{}: {cause}", path.display())]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    /// `manifest.json` is not JSON at all.
    #[error("{}: broken JSON at line {line} column {column}: {reason}", path.display())]
    Json {
        path: PathBuf,
        line: usize,
        column: usize,
        reason: String,
    },
    /// A field of the manifest, or an argument naming a stage, is wrong: `field` says which
    /// (`version`, `stages[3] "L0.out" file`).
    #[error("{}: {field}: {reason}", path.display())]
    Field {
        path: PathBuf,
        field: String,
        reason: String,
    },
    /// A `--full` pattern is not a glob.
    #[error("--full pattern `{pattern}`: {reason}")]
    Pattern { pattern: String, reason: String },
    /// A tensor file of the trace could not be read.
    #[error(transparent)]
    Tensors(#[from] WeightError),
}

impl TraceError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TraceError::Io {
            path: path.into(),
            cause: source,
        }
    }

    pub fn field(
        path: impl Into<PathBuf>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        TraceError::Field {
            path: path.into(),
            field: field.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = TraceError> = std::result::Result<T, E>;
