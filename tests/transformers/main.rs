//! glmcheck against torch and transformers (the `.venv` of `scripts/setup-venv`): the reference
//! forward against the model authors' classes, the transformers probe and its traces bisected,
//! synthetic models and tokenizers as transformers loads them, checkpoints transformers wrote,
//! and the CUDA side's NVRTC from torch's wheels.

#[path = "../common/mod.rs"]
mod common;

mod bisect_engine_trace;
mod cuda_host;
mod diff_classify;
mod diff_classify_ranks;
mod kv_b_transformers;
mod probe_transformers;
mod probe_transformers_tp;
mod run_deepseek_classes;
mod run_reference;
mod sglang_dumps;
mod sglang_passes;
mod synth_forms;
mod synth_tokenizer;
mod verify_hf;
