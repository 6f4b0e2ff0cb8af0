//! glmcheck against llama.cpp (built by `scripts/setup-llamacpp`): its converter, quantizer and
//! imatrix, its logits, its metadata defaults, and the llama.cpp probe's traces bisected.

#[path = "../common/mod.rs"]
mod common;

mod llamacpp_keys;
mod llamacpp_oracle;
mod probe_llamacpp;
mod quantize_llamacpp;
mod verify_llamacpp;
mod verify_llamacpp_cases;
