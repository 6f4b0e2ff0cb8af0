//! `synth --quant fp8-ue8m0`, DeepSeek-V3.1's FP8 layout, against torch
//! (`glmcheck_oracle.formats.ue8m0_checkpoint`): its bytes are torch's UE8M0 block quantization
//! of the f32 weights, every scale a power of two; `verify` and `dequant` pass it, and one scale
//! made 1.5× in the file's bytes fails `verify` at that scale tensor.

use crate::common;

use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use glmcheck::weights::safetensors::SafetensorsSet;
use serde_json::Value;

fn path(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

/// Multiply scale `index` of f32 tensor `name` in the checkpoint `dir` by `factor`, in place;
/// the new scale.
fn scale_in_bytes(dir: &Path, name: &str, index: u64, factor: f32) -> f32 {
    let (file, offset, old) = {
        let set = SafetensorsSet::open(dir).unwrap_or_else(|e| panic!("{e}"));
        let t = set.get(name).unwrap_or_else(|| panic!("no {name}"));
        let at = 4 * index as usize;
        let old = f32::from_le_bytes(set.bytes(t)[at..at + 4].try_into().unwrap());
        (set.path(t).to_path_buf(), t.offset + 4 * index, old)
    };
    let mut f = fs::OpenOptions::new().write(true).open(file).unwrap();
    f.seek(SeekFrom::Start(offset)).unwrap();
    f.write_all(&(old * factor).to_le_bytes()).unwrap();
    old * factor
}

#[test]
fn ue8m0_checkpoint_is_torchs_and_a_scale_off_the_powers_of_two_fails_verify() {
    let dir = common::scratch();
    let (plain, ue8m0) = (dir.path().join("f32"), dir.path().join("ue8m0"));
    common::synth_tiny(&plain, &["--format", "hf"]);
    common::synth_tiny(&ue8m0, &["--format", "hf", "--quant", "fp8-ue8m0"]);

    let report: Value = serde_json::from_str(&common::run_oracle(
        "formats.ue8m0_checkpoint",
        &[path(&plain), path(&ue8m0)],
    ))
    .unwrap();
    assert_eq!(report["problems"], Value::Array(vec![]), "{report:#}");
    let fp8 = report["fp8"].as_array().unwrap();
    assert!(
        fp8.iter()
            .any(|n| n == "model.layers.1.self_attn.o_proj.weight"),
        "{report:#}"
    );
    let config: Value =
        serde_json::from_slice(&fs::read(ue8m0.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["scale_fmt"], "ue8m0");
    assert_eq!(config["quantization_config"]["quant_method"], "fp8");

    // The same options write the same bytes.
    let again = dir.path().join("again");
    common::synth_tiny(&again, &["--format", "hf", "--quant", "fp8-ue8m0"]);
    let weights = |d: &Path| fs::read(d.join("model.safetensors")).unwrap();
    assert!(
        weights(&again) == weights(&ue8m0),
        "synth is not deterministic"
    );

    let verify =
        |code| common::glmcheck_json(["verify", path(&plain), path(&ue8m0), "--json"], code);
    let clean = verify(0);
    assert_eq!(clean["verdict"], "pass", "{:#}", clean["findings"]);
    let scale_lines = clean["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["tensor"].as_str().unwrap().ends_with("_scale_inv"))
        .count();
    assert_eq!(scale_lines, fp8.len(), "every scale tensor checked");
    let dequant = common::glmcheck_json(["dequant", path(&ue8m0), "--json"], 0);
    assert_eq!(dequant["verdict"], "pass");

    let name = "model.layers.1.self_attn.o_proj.weight_scale_inv";
    let planted = scale_in_bytes(&ue8m0, name, 1, 1.5);
    let broken = verify(1);
    assert_eq!(broken["verdict"], "fail");
    let findings = broken["findings"].as_array().unwrap();
    let f = findings
        .iter()
        .find(|f| f["tensor"] == name)
        .unwrap_or_else(|| panic!("{name} not named: {findings:#?}"));
    assert_eq!(f["relation"], "scale_format", "{f:#}");
    assert_eq!(f["class"], "scale_mismatch", "{f:#}");
    let evidence = f["evidence"][0].as_str().unwrap();
    assert!(
        evidence.contains(&format!("{name}: scale 1 "))
            && evidence.contains(&format!("{planted:e}")),
        "{evidence}"
    );
    let line = broken["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tensor"] == name)
        .unwrap();
    assert_eq!(line["status"], "fail");
}
