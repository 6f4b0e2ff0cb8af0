//! glmcheck against llama.cpp (built by `scripts/setup-llamacpp`): its converter, quantizer and
//! imatrix, its logits, its metadata defaults, the llama.cpp probe's traces bisected, and its
//! llama-server asked by `glmcheck endpoint`.

#[path = "../common/mod.rs"]
mod common;

mod endpoint_llama_server;
mod llamacpp_family;
mod llamacpp_keys;
mod llamacpp_oracle;
mod probe_llamacpp;
mod probe_llamacpp_family;
mod quantize_llamacpp;
mod verify_llamacpp;
mod verify_llamacpp_cases;
mod verify_llamacpp_family;
