//! glmcheck against gguf-py, numpy and safetensors (the `.venv` of `scripts/setup-venv`): the
//! GGUF and safetensors readers and writers, dequantizers and quantizers, the trace format and
//! its statistics, shard manifests, and a conversion planted with a fault.

#[path = "../common/mod.rs"]
mod common;

mod bisect_conversion;
mod cli_inspect;
mod dequant_oracle;
mod gguf_oracle;
mod quantize_oracle;
mod safetensors_reader;
mod shards_actual;
mod trace_format;
mod trace_format_writer;
