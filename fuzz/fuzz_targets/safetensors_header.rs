//! Any bytes as a safetensors file: the header checks, our error explanations and the dequantizers
//! of what it lists.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| glmcheck_fuzz::open_and_dequantize(data, "safetensors"));
