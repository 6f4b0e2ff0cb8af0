//! `glmcheck inspect` and `dequant` from the outside: exit codes, one-line errors, schema verdicts
//! on a synthetic glm-dsa GGUF (checked with gguf-py for the tensors llama.cpp's loader expects).

use crate::common;

use std::process::Output;

use glmcheck::synth::{Preset, SynthSpec};
use glmcheck::weights::gguf::writer::GgufWriter;
use glmcheck::weights::ModelFiles;
use serde_json::Value as Json;

fn one_line_error(out: &Output, naming: &str) {
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("glmcheck: error: ") && err.contains(naming),
        "{err}"
    );
}

#[test]
fn missing_and_unreadable_inputs_are_one_line_exit_2() {
    one_line_error(
        &common::glmcheck_output(&["inspect", "/no/such/model.gguf"]),
        "/no/such/model.gguf",
    );
    let dir = common::scratch();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\x00\x00\x00\xff\xff").unwrap();
    one_line_error(
        &common::glmcheck_output(&["dequant", junk.to_str().unwrap()]),
        "junk.gguf",
    );
    let model = dir.path().join("m.gguf");
    SynthSpec::new(Preset::Tiny.config(), 1)
        .write_gguf(&model)
        .unwrap();
    one_line_error(
        &common::glmcheck_output(&["dequant", "--tensor", "nothing*", model.to_str().unwrap()]),
        "m.gguf",
    );
}

#[test]
fn synthetic_glm_dsa_gguf_passes_the_schema_and_gguf_py_agrees() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    SynthSpec::new(Preset::Tiny.config(), 3)
        .write_gguf(&model)
        .unwrap();
    let report = common::glmcheck_json(["inspect", "--json", model.to_str().unwrap()], 0);
    assert_eq!(report["schema"]["ok"], true);
    assert_eq!(report["schema"]["report"]["layout"]["kv_b"], "split");
    assert_eq!(
        report["schema"]["report"]["mtp_layers"],
        serde_json::json!([Preset::Tiny.config().num_hidden_layers])
    );
    // gguf-py reads the same architecture, tensor names and shapes.
    let listing = common::run_oracle("formats.list_gguf", &[model.to_str().unwrap()]);
    let theirs: Json = serde_json::from_str(&listing).unwrap();
    assert_eq!(theirs["arch"], "glm-dsa");
    // Every tensor is one of the names gguf-py (llama.cpp's tensor table) gives glm-dsa.
    assert_eq!(theirs["unknown"], serde_json::json!([]));
    let ours: Vec<Json> = report["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| serde_json::json!([t["name"], t["shape"]]))
        .collect();
    assert_eq!(theirs["tensors"].as_array().unwrap(), &ours);
    // The file type llama.cpp's converter and quantizer record, by gguf-py's own names.
    assert_eq!(theirs["file_type"], "ALL_F32");
    let q4 = dir.path().join("q4.gguf");
    common::synth_tiny(&q4, &["--quant", "q4_k_m"]);
    let listing = common::run_oracle("formats.list_gguf", &[q4.to_str().unwrap()]);
    let theirs: Json = serde_json::from_str(&listing).unwrap();
    assert_eq!(theirs["file_type"], "MOSTLY_Q4_K_M");
}

#[test]
fn a_missing_tensor_fails_the_schema_with_exit_1() {
    let dir = common::scratch();
    let full = dir.path().join("full.gguf");
    SynthSpec::new(Preset::Tiny.config(), 3)
        .write_gguf(&full)
        .unwrap();
    let files = ModelFiles::open(&full).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in files.gguf().unwrap().metadata() {
        w.metadata(k.clone(), v.clone());
    }
    for t in files
        .tensors()
        .iter()
        .filter(|t| t.name != "blk.1.attn_v_b.weight")
    {
        let glmcheck::weights::Encoding::Ggml(ty) = t.encoding else {
            unreachable!()
        };
        w.tensor(t.name.clone(), ty, &t.shape, files.bytes(t).to_vec());
    }
    let broken = dir.path().join("broken.gguf");
    w.write(&broken).unwrap();
    let report = common::glmcheck_json(["inspect", "--json", broken.to_str().unwrap()], 1);
    assert_eq!(
        report["schema"]["report"]["missing"],
        serde_json::json!(["blk.1.attn_v_b.weight"])
    );
}
