//! A format-independent description of one stored tensor: its encoding, shape and bytes' place.

use super::ggml_type::GgmlType;

/// How a tensor's elements are encoded on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// A GGML type (GGUF tensors, and safetensors F32/F16/BF16/F64/I8…I64, which are the same bytes).
    Ggml(GgmlType),
    /// 8-bit float, 4 exponent and 3 mantissa bits (OCP "fn" variant: no infinities, NaN = 0x7f/0xff).
    F8E4M3,
    /// 8-bit float, 5 exponent and 2 mantissa bits.
    F8E5M2,
    /// 8-bit power of two (OCP E8M0: exponent only, 2^(e−127), 0xff NaN): DeepSeek-V3.1's
    /// UE8M0 block scales stored in their own dtype.
    F8E8M0,
    /// A safetensors dtype glmcheck stores but does not turn into f32 (BOOL, U8, U16, …).
    Other(String),
}

impl Encoding {
    /// Short name as users see it: `Q4_K`, `F8_E4M3`, `BOOL`.
    pub fn name(&self) -> &str {
        match self {
            Encoding::Ggml(t) => t.name(),
            Encoding::F8E4M3 => "F8_E4M3",
            Encoding::F8E5M2 => "F8_E5M2",
            Encoding::F8E8M0 => "F8_E8M0",
            Encoding::Other(s) => s,
        }
    }
}

impl std::fmt::Display for Encoding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor of a model: where its bytes are and how to read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub encoding: Encoding,
    /// Row-major shape, outermost dimension first (PyTorch order; a GGUF `ne` reversed).
    pub shape: Vec<u64>,
    /// Index of the file holding the bytes, in the model's file list.
    pub file: usize,
    /// Absolute byte offset of the first element in that file.
    pub offset: u64,
    /// Byte length.
    pub nbytes: u64,
}

impl TensorEntry {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Length of the innermost dimension (a "row"); 1 for a scalar.
    pub fn row_len(&self) -> u64 {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows (elements / row length).
    pub fn rows(&self) -> u64 {
        self.numel() / self.row_len().max(1)
    }
}
