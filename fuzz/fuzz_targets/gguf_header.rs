//! Any bytes as a GGUF file: the header parser and the dequantizers of what it lists.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| glmcheck_fuzz::open_and_dequantize(data, "gguf"));
