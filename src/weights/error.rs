//! The one error type of weight reading: every variant names the file and what in it was wrong.

use std::path::PathBuf;

/// A weight file could not be read, or a tensor in it could not be used.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// The I/O error is in the message, not a source: an error chain would print it twice.
    #[error("{}: {cause}", file.display())]
    Io {
        file: PathBuf,
        cause: std::io::Error,
    },
    /// The file's structure is broken: `field` names what was being read, `offset` where.
    #[error("{}: {field} at byte {offset}: {reason}", file.display())]
    Malformed {
        file: PathBuf,
        field: String,
        offset: u64,
        reason: String,
    },
    /// The structure is sound but one tensor cannot be used as asked.
    #[error("{}: tensor `{tensor}`: {reason}", file.display())]
    Tensor {
        file: PathBuf,
        tensor: String,
        reason: String,
    },
    /// No tensor of that name in the model.
    #[error("{}: no tensor named `{tensor}`", file.display())]
    NoSuchTensor { file: PathBuf, tensor: String },
}

impl WeightError {
    pub fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        WeightError::Io {
            file: file.into(),
            cause: source,
        }
    }

    pub fn malformed(
        file: impl Into<PathBuf>,
        field: impl Into<String>,
        offset: u64,
        reason: impl Into<String>,
    ) -> Self {
        WeightError::Malformed {
            file: file.into(),
            field: field.into(),
            offset,
            reason: reason.into(),
        }
    }

    pub fn tensor(
        file: impl Into<PathBuf>,
        tensor: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        WeightError::Tensor {
            file: file.into(),
            tensor: tensor.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T, E = WeightError> = std::result::Result<T, E>;
