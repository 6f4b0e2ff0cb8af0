//! Reading weights: GGUF and safetensors files, GGML dequantizers, GLM-5 names and kv_b assembly.

pub mod error;
pub mod file_read;
pub mod fp8;
pub mod ggml_type;
pub mod quant;
pub mod quantize;
pub mod safetensors;
pub mod tensor;

pub use error::{Result, WeightError};
pub use ggml_type::GgmlType;
pub use tensor::{Encoding, TensorEntry};
pub mod gguf;
pub mod model_files;
pub mod pages;
pub mod read_ahead;
pub use model_files::ModelFiles;
pub mod health;
pub mod safetensors_writer;
