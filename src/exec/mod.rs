//! The CPU reference executor: GLM-5's forward, stage by stage, recorded into a trace.

pub mod attention;
pub mod backend;
pub mod cpu;
pub mod faults;
pub mod forward;
pub mod mat;
pub mod ops;
pub mod passes;
pub mod real;
pub mod selftest;
pub mod source;
pub mod storage;
pub mod tp;
