//! Any bytes as an engine's shard manifest (`glmcheck shards --actual`): parsing and the checks
//! of every field.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| glmcheck_fuzz::read_shard_manifest(data));
