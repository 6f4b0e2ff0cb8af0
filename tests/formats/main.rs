//! glmcheck against gguf-py, numpy and safetensors (the `.venv` of `scripts/setup-venv`): the
//! GGUF and safetensors readers and writers, dequantizers and quantizers, the trace format and
//! its statistics, shard manifests, DeepSeek-V3.1's UE8M0 FP8 checkpoints, and a conversion
//! planted with a fault.

#[path = "../common/mod.rs"]
mod common;

mod bisect_conversion;
mod cli_inspect;
mod dequant_oracle;
mod fp8_ue8m0;
mod gguf_oracle;
mod quantize_oracle;
mod safetensors_reader;
mod shards_actual;
mod trace_format;
mod trace_format_writer;
