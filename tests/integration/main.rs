//! Integration tests that need no oracle beyond Rust and a Python interpreter: bisect and its
//! planted faults, the command line on hostile input, the layer rules of `src/`, partial traces,
//! rank processes, tensor parallelism on the CPU, stored blocks, the gate.

#[path = "../common/mod.rs"]
mod common;

mod bisect_faults;
mod bisect_library;
mod cli_shards;
mod endpoint;
mod gate;
mod gate_reports;
mod hostile_files;
mod layers;
mod partial_trace;
mod rank_processes;
mod run_profile;
mod run_tp;
mod stored_blocks;
mod synth_fp16;
