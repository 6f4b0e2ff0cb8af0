//! glmcheck against vLLM's own code (the CPU builds `scripts/setup-vllm` installs): 0.23's GGUF
//! loader at tensor parallelism, and 0.32's model trees run as users run them, with faults planted
//! inside vLLM.

#[path = "../common/mod.rs"]
mod common;

mod endpoint;
mod vllm32;
mod vllm_gguf_load;
mod vllm_today;
mod vllm_today_family;
mod vllm_today_fp8;
mod vllm_today_gguf;
mod vllm_today_server;
