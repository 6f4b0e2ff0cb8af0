//! The llama.cpp probe on the family's `deepseek2` graphs: tiny random members built by
//! transformers' own classes and converted by llama.cpp's converter
//! (`glmcheck_oracle.llamacpp.family`), run by llama.cpp with the probe's default recording and
//! bisected against the transformers folder they were converted from.
//!
//! Clean conversions of DeepSeek-V3 (YaRN), V2-Lite (no q LoRA: `attn_q`), Kimi-K2 and
//! GLM-4.7-Flash pass. Keys an older converter left out of the file, as users meet them: without
//! `rope.scaling.yarn_log_multiplier` llama.cpp scales cos/sin by YaRN's mscale (DeepSeek's YaRN
//! leaves them unscaled), named from the metadata at `L0.attn.q_rope`; without
//! `expert_gating_func` it scores V3's router with softmax, named at the first MoE layer. In both
//! glmcheck's own reading of the file agrees with llama.cpp's run of it.

use crate::common;
use crate::llamacpp_family::make_model;
use crate::probe_llamacpp::probe_with;

use std::path::Path;

use serde_json::Value;

const TOKENS: &str = "1,5,9,33,70,100,200,300";

/// `glmcheck bisect REFERENCE --candidate TRACE --json`, whose exit code says the verdict.
fn bisect(reference: &Path, trace: &Path) -> Value {
    let run = common::glmcheck_output(&[
        "bisect",
        reference.to_str().unwrap(),
        "--candidate",
        trace.to_str().unwrap(),
        "--json",
    ]);
    let v: Value = serde_json::from_slice(&run.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&run.stderr)));
    let code = if v["verdict"] == "pass" { 0 } else { 1 };
    assert_eq!(run.status.code(), Some(code), "{v:#}");
    v
}

/// The member `arch` converted (with the oracle's `extra` options) and run by llama.cpp under
/// the probe's default recording: (the transformers folder, the GGUF, the trace).
fn probed(
    dir: &Path,
    arch: &str,
    extra: &[&str],
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let model = make_model(&dir.join(arch), arch, extra, &[TOKENS]);
    let trace = dir.join(format!("{arch}.trace"));
    probe_with(model.gguf.to_str().unwrap(), &trace, TOKENS, &[]);
    (model.gguf.with_file_name("hf"), model.gguf, trace)
}

#[test]
fn clean_conversions_of_the_family_pass_through_the_probe() {
    let dir = common::scratch();
    for (arch, extra) in [
        ("v3", &["--yarn"][..]),
        ("v2-lite", &[]),
        ("kimi-k2", &["--yarn"]),
        ("glm-4.7-flash", &[]),
    ] {
        let (hf, _, trace) = probed(dir.path(), arch, extra);
        let v = bisect(&hf, &trace);
        assert_eq!(v["verdict"], "pass", "{arch}: {v:#}");
        let manifest: Value =
            serde_json::from_str(&std::fs::read_to_string(trace.join("manifest.json")).unwrap())
                .unwrap();
        let stages: Vec<&str> = manifest["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap())
            .collect();
        // DeepSeek's graph names every step of its query `q`: q_a's product, its norm and q_b's
        // are told apart, and V2-Lite's single `attn_q` is the query itself.
        let q_lora = arch != "v2-lite";
        for stage in ["L0.attn.q_a", "L0.attn.q_a_norm"] {
            assert_eq!(
                stages.contains(&stage),
                q_lora,
                "{arch}: {stage} in {stages:?}"
            );
        }
        for stage in [
            "L0.attn.q",
            "L0.attn.q_rope",
            "L0.attn.ctx",
            "L1.moe.topk_ids",
            "logits",
        ] {
            assert!(stages.contains(&stage), "{arch}: {stage} not in {stages:?}");
        }
    }
}

#[test]
fn a_file_without_its_yarn_log_multiplier_is_named_from_the_metadata_llama_cpp_read() {
    let dir = common::scratch();
    let extra = ["--yarn", "--drop-key", "rope.scaling.yarn_log_multiplier"];
    let (hf, gguf, trace) = probed(dir.path(), "v3", &extra);
    let v = bisect(&hf, &trace);
    assert_eq!(v["verdict"], "fail", "{v:#}");
    let fault = &v["fault"];
    assert_eq!(fault["class"], "rope_mismatch", "{v:#}");
    assert_eq!(v["first_divergence"]["stage"], "L0.attn.q_rope", "{v:#}");
    let summary = fault["summary"].as_str().unwrap();
    assert!(
        summary.contains("deepseek2.rope.scaling.yarn_log_multiplier = absent"),
        "{summary}"
    );
    // glmcheck reads the file as llama.cpp runs it.
    let own = bisect(&gguf, &trace);
    assert_eq!(own["verdict"], "pass", "{own:#}");
}

#[test]
fn a_v3_file_without_its_gating_func_is_named_at_the_first_moe_layer() {
    let dir = common::scratch();
    let extra = ["--yarn", "--drop-key", "expert_gating_func"];
    let (hf, gguf, trace) = probed(dir.path(), "v3", &extra);
    let v = bisect(&hf, &trace);
    assert_eq!(v["verdict"], "fail", "{v:#}");
    assert_eq!(v["fault"]["class"], "router_mismatch", "{v:#}");
    assert_eq!(v["first_divergence"]["layer"], 1, "{v:#}");
    let summary = v["fault"]["summary"].as_str().unwrap();
    assert!(
        summary.contains("deepseek2.expert_gating_func"),
        "{summary}"
    );
    let own = bisect(&gguf, &trace);
    assert_eq!(own["verdict"], "pass", "{own:#}");
}
