//! The CUDA side on a machine without a GPU, as every machine with a Rust toolchain here is:
//! `dequant --device cuda` says that no CUDA driver was found and exits 2 — it neither panics
//! nor pretends. The GPU checks themselves run on the GPU machine (`just gpu-dequant-check`).

mod common;

use std::process::Command;

#[test]
fn without_a_driver_cuda_commands_say_so() {
    let dir = common::scratch();
    let model = dir.path().join("m.gguf");
    common::synth_tiny(&model, &["--quant", "q8_0"]);
    let out = Command::new(common::glmcheck_bin())
        .args(["dequant", model.to_str().unwrap(), "--device", "cuda"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CUDA driver found"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
}
