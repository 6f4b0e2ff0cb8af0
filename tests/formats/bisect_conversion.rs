//! `glmcheck bisect HF --candidate GGUF`: a conversion is judged against the reference with
//! every weight stored as the GGUF stores it, and its weights checked as `glmcheck verify` checks
//! them, so a correct conversion passes at f32, q8_0 and q4_k_m (every tensor ggml's bytes),
//! while a GGUF whose kv_b was split wrongly (rows of the re-assembled kv_b moved), or whose
//! attn_k_b lacks its per-head transpose (written by gguf-py from the correct F32 file), is a
//! `weight_layout` at `L0.attn.kv` naming `blk.0.attn_k_b.weight`; a candidate whose Q4_K
//! dequantizer is broken is a `wrong_dequant`: its reading of its own bytes differs. A split
//! kv_b of a shape no config explains is a one-line error.

use crate::common;

use std::path::Path;

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";
fn bisect(hf: &Path, candidate: &Path, extra: &[&str], code: i32) -> serde_json::Value {
    common::bisect_candidate(
        hf,
        candidate,
        &[&["--tokens", TOKENS], extra].concat(),
        code,
    )
}

#[test]
fn conversions_pass_within_their_quantization_noise_and_broken_splits_do_not() {
    let dir = common::scratch();
    let hf = dir.path().join("hf");
    common::synth_tiny(&hf, &["--format", "hf"]);
    for quant in ["f32", "q8_0", "q4_k_m"] {
        let gguf = dir.path().join(format!("{quant}.gguf"));
        common::synth_tiny(&gguf, &["--quant", quant]);
        let j = bisect(&hf, &gguf, &[], 0);
        assert_eq!(j["verdict"], "pass", "{quant}: {:#}", j["fault"]);
        assert_eq!(j["bisect"]["conversion"], true);
        let w = &j["bisect"]["weights"];
        assert_eq!(
            (&w["checked"], &w["failed"]),
            (&"all".into(), &0.into()),
            "{quant}"
        );
        assert_eq!(
            w["exact"], w["tensors"],
            "{quant}: every tensor is ggml's bytes"
        );
        assert!(j["bisect"]["envelope"].is_string());
        if quant == "q4_k_m" {
            // The noise is real: far beyond f32's, yet inside the storage envelope.
            assert!(j["tolerance_to_pass"].as_f64().unwrap() > 1e-4, "{quant}");
        }
    }
    let f32_gguf = dir.path().join("f32.gguf");
    for mode in ["split-order", "no-transpose"] {
        let bad = dir.path().join(format!("{mode}.gguf"));
        common::run_oracle(
            "formats.break_kv_b",
            &[f32_gguf.to_str().unwrap(), bad.to_str().unwrap(), mode],
        );
        let j = bisect(&hf, &bad, &[], 1);
        assert_eq!(j["first_divergence"]["stage"], "L0.attn.kv", "{mode}");
        assert_eq!(
            j["fault"]["class"], "weight_layout",
            "{mode}: {:#}",
            j["fault"]
        );
        assert_eq!(j["fault"]["weight"], "blk.0.attn_k_b.weight", "{mode}");
        assert_eq!(j["bisect"]["classified_by"], "weights");
        let relation = if mode == "split-order" {
            "row_permutation"
        } else {
            "transpose"
        };
        assert_eq!(
            j["bisect"]["weights"]["findings"][0]["relation"], relation,
            "{mode}"
        );
    }
    let q4 = dir.path().join("q4_k_m.gguf");
    let j = bisect(&hf, &q4, &["--inject", "dequant-q4k-scales"], 1);
    assert_eq!(j["fault"]["class"], "wrong_dequant", "{:#}", j["fault"]);
    assert!(
        j["fault"]["summary"]
            .as_str()
            .unwrap()
            .contains("dequantization of the same bytes differs"),
        "{:#}",
        j["fault"]
    );
    assert_eq!(
        j["bisect"]["weights"]["failed"], 0,
        "the file itself is honest"
    );
}

/// A split kv_b whose shape no config explains (one head too many in layer 0's `attn_k_b`) is
/// a one-line error naming the file, the tensor and its shape, exit 2: not a silent read of its
/// first heads.
#[test]
fn a_split_kv_b_of_the_wrong_shape_is_a_one_line_error() {
    let dir = common::scratch();
    let (good, bad) = (dir.path().join("f32.gguf"), dir.path().join("extra.gguf"));
    common::synth_tiny(&good, &["--quant", "f32"]);
    common::run_oracle(
        "formats.break_kv_b",
        &[good.to_str().unwrap(), bad.to_str().unwrap(), "extra-head"],
    );
    let err = common::run_error_line(&bad);
    for part in [
        bad.to_str().unwrap(),
        "blk.0.attn_k_b.weight",
        "shape",
        "attn_k_b holds",
    ] {
        assert!(err.contains(part), "{part}: {err}");
    }
}
