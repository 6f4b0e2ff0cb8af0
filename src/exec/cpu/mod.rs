//! The CPU backend's kernels: its linear (`y = x · wᵀ`) over weights held as values or as GGML
//! blocks, the GEMM and few-token kernels under it.

pub mod few_tokens;
pub mod gemm_kernel;
pub mod host_linear;
pub mod host_weight;
