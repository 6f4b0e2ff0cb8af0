//! SGLang's older dump (`--debug-tensor-dump-output-folder`): a folder per rank with one
//! `Pass{N}.pt` per forward, written by the unmodified `tensor_dump_forward_hook.py` of the pinned
//! wheel around the SGLang-named model. Its hooks see leaf modules' outputs only, and a pass's
//! logits land in the next pass's file: what it cannot show is listed as never compared, and the
//! faults are still located and classed.

use crate::common;
use crate::sglang_dumps::{dump_tokens, faults_located, tiny_hf, FAULTS_EITHER_SHOWS};

/// A prefill and one decode step, so the prefill's logits are written (with the second pass).
const TOKENS: &str = "5,17,99";

fn not_recorded(j: &serde_json::Value) -> Vec<&str> {
    j["bisect"]["not_recorded"]
        .as_array()
        .map(|a| a.iter().map(|s| s.as_str().unwrap()).collect())
        .unwrap_or_default()
}

#[test]
fn pass_files_bisect_with_the_logits_of_the_next_pass() {
    let dir = common::scratch();
    let hf = tiny_hf(dir.path());
    let two = dir.path().join("two");
    dump_tokens(
        &hf,
        TOKENS,
        &two,
        "2",
        &["--mechanism", "tensor-hook", "--steps", "2"],
    );
    let j = common::bisect_candidate(&hf, &two, &[], 0);
    assert_eq!(j["verdict"], "pass", "{:#}", j["fault"]);
    let missing = not_recorded(&j);
    // Output hooks on leaf modules: the MoE block's sums are never shown; the rest is.
    assert!(
        missing.contains(&"L1.ffn.out") && missing.contains(&"L1.moe.routed"),
        "{missing:?}"
    );
    for shown in [
        "logits",
        "L0.ffn.out",
        "L1.attn.ctx",
        "L1.moe.shared",
        "L2.out",
    ] {
        assert!(!missing.contains(&shown), "{shown}: {missing:?}");
    }

    let one = dir.path().join("one");
    dump_tokens(&hf, TOKENS, &one, "2", &["--mechanism", "tensor-hook"]);
    let j = common::bisect_candidate(&hf, &one, &[], 0);
    assert!(not_recorded(&j).contains(&"logits"));
    let notes = j["bisect"]["candidate_notes"].to_string();
    assert!(notes.contains("max_new_tokens 2"), "{notes}");
}

#[test]
fn faults_in_pass_files_are_located_and_classed() {
    // The MoE block's output is not shown: the layer's output is fitted on its terms.
    let scale = ("routed-scale-twice", "L1.out", "scale_mismatch");
    let table = [&FAULTS_EITHER_SHOWS[..], &[scale]].concat();
    let args = ["--mechanism", "tensor-hook", "--steps", "2"];
    faults_located("glm5", (TOKENS, "2"), &args, &table);
}
