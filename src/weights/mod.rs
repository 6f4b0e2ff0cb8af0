//! Reading weights: GGUF and safetensors files, GGML dequantizers, GLM-5 names and kv_b assembly.

pub mod ggml_type;
pub mod quant;
