//! Any bytes as one file of an SGLang dump: the zip archive, the data-only pickle and the
//! tensor's storage record.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| glmcheck_fuzz::read_sglang_file(data));
