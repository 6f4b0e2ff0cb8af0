//! The llama.cpp probe on the family's `deepseek2` and `deepseek32` graphs: tiny random members
//! built by transformers' own classes and converted by llama.cpp's converter
//! (`glmcheck_oracle.llamacpp.family`), run by llama.cpp with the probe's default recording and
//! bisected against the transformers folder they were converted from.
//!
//! Clean conversions of DeepSeek-V3 (YaRN), V2-Lite (no q LoRA: `attn_q`), Kimi-K2,
//! GLM-4.7-Flash and V3.2 (its indexer's choices compared) pass. YaRN as llama.cpp reads it
//! from the metadata, named at `L0.attn.q_rope`: a file an older converter left without
//! `rope.scaling.yarn_log_multiplier` scales cos/sin by YaRN's mscale (DeepSeek's YaRN leaves
//! them unscaled); a V3.2 file whose mscale_all_dim is 0.707 scales them by 1.0531 (deepseek32
//! takes mscale 1). Without `expert_gating_func` llama.cpp scores V3's router with softmax,
//! named at the first MoE layer. In each, glmcheck's own reading of the file agrees with
//! llama.cpp's run of it.

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
        ("v32", &["--yarn"]),
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
        // V3.2's indexer is recorded and its choices compared.
        assert_eq!(
            stages.contains(&"L0.attn.index_topk"),
            arch == "v32",
            "{arch}: {stages:?}"
        );
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

/// `arch` converted with `extra` and probed: the settings diagnosis names `key` (with what
/// llama.cpp made of it, `found`) at `L0.attn.q_rope` against the transformers folder, and
/// glmcheck's own reading of the file passes.
fn yarn_named_from_metadata(arch: &str, extra: &[&str], key: &str, found: &str) {
    let dir = common::scratch();
    let (hf, gguf, trace) = probed(dir.path(), arch, extra);
    let v = bisect(&hf, &trace);
    assert_eq!(v["verdict"], "fail", "{v:#}");
    let fault = &v["fault"];
    assert_eq!(fault["class"], "rope_mismatch", "{v:#}");
    assert_eq!(v["first_divergence"]["stage"], "L0.attn.q_rope", "{v:#}");
    let summary = fault["summary"].as_str().unwrap();
    assert!(
        summary.contains(key) && summary.contains(found),
        "{summary}"
    );
    // glmcheck reads the file as llama.cpp runs it.
    let own = bisect(&gguf, &trace);
    assert_eq!(own["verdict"], "pass", "{own:#}");
}

#[test]
fn a_file_without_its_yarn_log_multiplier_is_named_from_the_metadata_llama_cpp_read() {
    yarn_named_from_metadata(
        "v3",
        &["--yarn", "--drop-key", "rope.scaling.yarn_log_multiplier"],
        "deepseek2.rope.scaling.yarn_log_multiplier",
        "absent",
    );
}

/// DeepSeek-V2-Lite's YaRN (mscale_all_dim 0.707) in a V3.2 file: llama.cpp's deepseek32 takes
/// mscale 1 beside it, scaling cos/sin by mscale(1)/mscale(0.707) = 1.0531 and the softmax by
/// mscale(1)² = 1.4591 where transformers takes mscale(0.707)² = 1.3156.
#[test]
fn a_deepseek32_file_with_another_mscale_all_dim_is_named_from_the_metadata() {
    let yarn = r#"rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 0.707}"#;
    yarn_named_from_metadata(
        "v32",
        &["--set", yarn],
        "deepseek32.rope.scaling.yarn_log_multiplier",
        "(llama.cpp: cos/sin × 1.0531, softmax scale × 1.4591)",
    );
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
