//! Any bytes as a trace's `manifest.json`: the manifest checks and the tensor reads it leads to.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| glmcheck_fuzz::open_trace(data));
