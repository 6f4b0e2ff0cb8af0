//! `glmcheck verify` and `glmcheck bisect --candidate` on the family's other members as
//! llama.cpp's own tools make their GGUFs, with faults planted in the stored bytes.
//!
//! `glmcheck_oracle.llamacpp.family --wide` builds each member with its transformers class, wide
//! enough for K-quants (rows of 256 or 512 values, as `verify_llamacpp`'s GLM-5), converts it with
//! llama.cpp's converter to an F32 GGUF (`deepseek2`; `deepseek32` for V3.2) and quantizes that
//! with `llama-quantize` to Q8_0 and Q4_K_M (`--quantize`): DeepSeek-V3 with YaRN, V2-Lite (no q
//! LoRA, softmax routing without groups; 27 layers, llama.cpp's test for it, all but the last two
//! dense), Kimi-K2 (one expert group), GLM-4.7-Flash and V3.2 with YaRN (its DSA indexer, whose
//! `attn_k` llama-quantize stores as Q8_0 in a Q4_K_M). attn_k_b's rows are 64 long, so
//! llama-quantize falls back for it (Q4_K_M: Q5_0), as on the real models.
//!
//! Every honest file passes both commands against the Hugging Face folder, and the quantized ones
//! against the F32 GGUF too: no finding, every tensor exactly glmcheck's re-quantization, bisect
//! naming no weight and, past F32, at most `precision_loss`. Every planted fault
//! (`glmcheck_oracle.formats.plant_gguf_fault`) fails both: verify names the planted tensor, and
//! only it, with the fault's class and relation; bisect gives the class and the tensor. Each
//! member's results print as a Markdown table (`--nocapture`).
//!
//! llama.cpp comes from `scripts/setup-llamacpp`: this test fails, never skips, without it.

use crate::common;
use crate::llamacpp_oracle::llama_cpp;
use crate::verify_llamacpp::{
    bisect, bisect_cell, exit, plant_and_judge, verify, verify_cell, Row,
};
use crate::verify_llamacpp_cases::Fault;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// llama-quantize's types made of every member (the keys of `llamacpp.family`'s `quants`).
const QUANTS: [&str; 2] = ["Q8_0", "Q4_K_M"];

const fn fault(
    file: &'static str,
    fault: &'static str,
    tensor: &'static str,
    args: &'static [&'static str],
    (class, relation): (&'static str, &'static str),
) -> Fault {
    Fault {
        file,
        fault,
        tensor,
        args,
        class,
        relation,
        gguf_reference: false,
    }
}

const EXPERTS: (&str, &str) = ("weight_layout", "expert_permutation");
const HEADS: (&str, &str) = ("weight_layout", "head_permutation");
const SCALED: (&str, &str) = ("scale_mismatch", "scalar_multiple");
const ROUTER_ZEROS: (&str, &str) = ("router_mismatch", "zeros");

/// What `llamacpp.family` made for one member: the files by key ("hf", "f32", `QUANTS`) and
/// every tensor's GGML type by file.
struct Member {
    arch: &'static str,
    dir: PathBuf,
    files: BTreeMap<String, PathBuf>,
    types: Value,
}

impl Member {
    fn file(&self, key: &str) -> &Path {
        self.files
            .get(key)
            .unwrap_or_else(|| panic!("llamacpp.family made no {key} of {}", self.arch))
    }

    fn ty(&self, file: &str, tensor: &str) -> &str {
        self.types[file][tensor]
            .as_str()
            .unwrap_or_else(|| panic!("{} {file} has no tensor {tensor}", self.arch))
    }
}

/// The member `arch` (with `extra` options of `llamacpp.family`), wide and quantized, in a fresh
/// folder of the target directory (kept to look into a failure).
fn make(arch: &'static str, extra: &[&str]) -> Member {
    let oracle = llama_cpp();
    assert!(
        oracle.join("build/tools/quantize/llama-quantize").is_file(),
        "llama.cpp's llama-quantize is not built: run scripts/setup-llamacpp"
    );
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("verify-llamacpp-family")
        .join(arch);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    let src = oracle.join("src");
    let mut args = vec![
        dir.to_str().unwrap(),
        arch,
        "--llama-cpp",
        src.to_str().unwrap(),
        "--wide",
    ];
    args.extend(extra);
    for q in QUANTS {
        args.extend(["--quantize", q]);
    }
    let stdout = common::run_oracle("llamacpp.family", &args);
    let json: Value =
        serde_json::from_str(stdout.lines().last().expect("llamacpp.family prints JSON")).unwrap();
    let mut files = BTreeMap::new();
    files.insert(
        "hf".to_string(),
        PathBuf::from(json["hf"].as_str().unwrap()),
    );
    files.insert(
        "f32".to_string(),
        PathBuf::from(json["gguf"].as_str().unwrap()),
    );
    for (k, v) in json["quants"].as_object().unwrap() {
        files.insert(k.clone(), PathBuf::from(v.as_str().unwrap()));
    }
    Member {
        arch,
        dir,
        files,
        types: json["types"].clone(),
    }
}

fn file_name(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

/// An honest file: both commands pass with nothing found; verify reproduces llama.cpp's bytes.
fn honest(m: &Member, key: &str, reference: &'static str) -> Row {
    let (reference_path, candidate) = (m.file(reference), m.file(key));
    let mut problems = Vec::new();

    let (vcode, v, stderr) = verify(reference_path, candidate);
    exit(&mut problems, "verify", vcode, 0, &stderr);
    if v["verdict"] != "pass" || v["summary"]["failed"] != 0 || v["findings"] != json!([]) {
        problems.push(format!(
            "verify verdict {}, {} failed, findings {}",
            v["verdict"], v["summary"]["failed"], v["findings"]
        ));
    }
    if v["candidate_imatrix"] != false {
        problems.push(format!("candidate_imatrix is {}", v["candidate_imatrix"]));
    }
    let tensors = v["tensors"].as_array().cloned().unwrap_or_default();
    let listed = m.types[key].as_object().map_or(0, |t| t.len());
    if tensors.len() != listed {
        problems.push(format!(
            "verify listed {} tensors, the file has {listed}",
            tensors.len()
        ));
    }
    for t in tensors.iter().filter(|t| t["status"] != "exact") {
        problems.push(format!(
            "{} ({}) is {} (rel_diff {}, noise {})",
            t["tensor"], t["type"], t["status"], t["rel_diff"], t["noise"]
        ));
    }

    let (bcode, b, stderr) = bisect(reference_path, candidate);
    exit(&mut problems, "bisect", bcode, 0, &stderr);
    if b["verdict"] != "pass" || !b["fault"]["weight"].is_null() {
        problems.push(format!(
            "bisect verdict {}, blames {}",
            b["verdict"], b["fault"]["weight"]
        ));
    }
    // F32 against the checkpoint it was converted from runs the same values; a quantization
    // departs by its rounding alone.
    let class = &b["fault"]["class"];
    let expected = if key == "f32" {
        class.is_null()
    } else {
        class.is_null() || class == "precision_loss"
    };
    if !expected {
        problems.push(format!("bisect class {class}"));
    }
    let weights = &b["bisect"]["weights"];
    if !(weights["checked"] == "all" && weights["failed"] == 0 && weights["findings"] == json!([]))
    {
        problems.push(format!("bisect weight check: {weights}"));
    }

    Row {
        file: file_name(candidate),
        reference,
        fault: "none".into(),
        tensor: format!(
            "{} of {} exact",
            tensors.iter().filter(|t| t["status"] == "exact").count(),
            tensors.len()
        ),
        verify: verify_cell(vcode, &v),
        bisect: bisect_cell(bcode, &b),
        problems,
    }
}

/// A planted fault: both commands fail, naming the planted tensor and only it.
fn planted(m: &Member, f: &Fault, reference: &'static str) -> Row {
    let reference_path = m.file(reference);
    let candidate = m.dir.join(format!(
        "{}-{}-{}-{reference}.gguf",
        f.file.to_lowercase(),
        f.fault,
        f.tensor.trim_end_matches(".weight")
    ));
    let (verify, bisect, problems) = plant_and_judge(m.file(f.file), &candidate, reference_path, f);
    Row {
        file: file_name(m.file(f.file)),
        reference,
        fault: format!("{} {}", f.fault, f.args.join(" "))
            .trim()
            .to_string(),
        tensor: format!("`{}` ({})", f.tensor, m.ty(f.file, f.tensor)),
        verify,
        bisect,
        problems,
    }
}

/// Builds the member, runs every honest file and every fault of `faults`, prints the table and
/// fails with every case that did not pass.
fn check_member(arch: &'static str, extra: &[&str], faults: &[Fault]) {
    let start = std::time::Instant::now();
    let m = make(arch, extra);
    let made = start.elapsed().as_secs_f64();
    let mut rows = vec![honest(&m, "f32", "hf")];
    for q in QUANTS {
        rows.push(honest(&m, q, "hf"));
        rows.push(honest(&m, q, "f32"));
    }
    for f in faults {
        rows.push(planted(&m, f, "hf"));
        if f.gguf_reference {
            rows.push(planted(&m, f, "f32"));
        }
    }

    let mut table = String::from(
        "| file | reference | fault | tensor (type) | verify: class/relation | bisect: class / stage | |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for r in &rows {
        let reference = if r.reference == "hf" {
            "hf/"
        } else {
            "model-f32.gguf"
        };
        let ok = if r.problems.is_empty() {
            "pass"
        } else {
            "FAIL"
        };
        table.push_str(&format!(
            "| {} | {reference} | {} | {} | {} | {} | {ok} |\n",
            r.file, r.fault, r.tensor, r.verify, r.bisect
        ));
    }
    println!(
        "{arch} {extra:?}: files made in {made:.1} s, {} cases in {:.1} s\n{table}",
        rows.len(),
        start.elapsed().as_secs_f64() - made
    );
    let failures: Vec<String> = rows
        .iter()
        .filter(|r| !r.problems.is_empty())
        .map(|r| {
            format!(
                "{} (reference {}) {} {}: {}",
                r.file,
                r.reference,
                r.fault,
                r.tensor,
                r.problems.join("; ")
            )
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{arch}: {} of {} cases failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}

/// DeepSeek-V3 with YaRN: routed experts (group-limited, biased sigmoid choice), its choice
/// bias, and attn_k_b's heads written untransposed by a converter.
#[test]
fn deepseek_v3_yarn_quantized() {
    check_member(
        "v3",
        &["--yarn"],
        &[
            Fault {
                gguf_reference: true,
                ..fault(
                    "Q4_K_M",
                    "swap-experts",
                    "blk.1.ffn_down_exps.weight",
                    &["1", "5"],
                    EXPERTS,
                )
            },
            fault("Q8_0", "zero", "blk.2.exp_probs_b.bias", &[], ROUTER_ZEROS),
            // [4 heads, 256, 64]: each head's values written in 64 x 256 order.
            fault(
                "f32",
                "untranspose-heads",
                "blk.0.attn_k_b.weight",
                &[],
                ("weight_layout", "transpose"),
            ),
        ],
    );
}

/// DeepSeek-V2-Lite: its query straight from the hidden state (`attn_q`), heads of attn_k_b
/// (Q5_0 in the Q4_K_M) and attn_v_b, the experts of a softmax router, rows of another layer.
#[test]
fn deepseek_v2_lite_quantized() {
    check_member(
        "v2-lite",
        &[],
        &[
            // Every Q8_0 block scale doubled.
            Fault {
                gguf_reference: true,
                ..fault("Q8_0", "scale", "blk.0.attn_q.weight", &["2"], SCALED)
            },
            fault(
                "Q4_K_M",
                "swap-heads",
                "blk.3.attn_k_b.weight",
                &["0", "3"],
                HEADS,
            ),
            fault(
                "Q8_0",
                "swap-heads",
                "blk.5.attn_v_b.weight",
                &["1", "2"],
                HEADS,
            ),
            fault(
                "Q8_0",
                "swap-experts",
                "blk.26.ffn_gate_exps.weight",
                &["2", "6"],
                EXPERTS,
            ),
            fault(
                "Q4_K_M",
                "copy-rows",
                "blk.20.attn_output.weight",
                &["blk.19.attn_output.weight", "0", "16"],
                ("corrupt_weight", "other_tensor"),
            ),
        ],
    );
}

/// Kimi-K2 (one expert group): routed experts, its choice bias, garbage in the latent KV.
#[test]
fn kimi_k2_quantized() {
    check_member(
        "kimi-k2",
        &[],
        &[
            fault(
                "Q4_K_M",
                "swap-experts",
                "blk.2.ffn_up_exps.weight",
                &["0", "7"],
                EXPERTS,
            ),
            fault("Q8_0", "zero", "blk.2.exp_probs_b.bias", &[], ROUTER_ZEROS),
            // Blocks 0 and 1 of row 5 (8 Q8_0 blocks a row).
            fault(
                "Q8_0",
                "garbage",
                "blk.0.attn_kv_a_mqa.weight",
                &["5", "0", "2", "7"],
                ("corrupt_weight", "garbage_blocks"),
            ),
        ],
    );
}

/// GLM-4.7-Flash: a NaN block scale in an expert, doubled K-quant scales, its choice bias.
#[test]
fn glm_4_7_flash_quantized() {
    check_member(
        "glm-4.7-flash",
        &[],
        &[
            // Row 44 of expert 1.
            fault(
                "Q8_0",
                "nan-scale",
                "blk.1.ffn_down_exps.weight",
                &["300", "0"],
                ("nan_origin", "nan_inf"),
            ),
            fault(
                "Q4_K_M",
                "scale",
                "blk.2.attn_output.weight",
                &["2"],
                SCALED,
            ),
            fault(
                "Q4_K_M",
                "zero",
                "blk.1.exp_probs_b.bias",
                &[],
                ROUTER_ZEROS,
            ),
        ],
    );
}

/// DeepSeek-V3.2 with YaRN: its DSA indexer's key projection (Q8_0 in the Q4_K_M), query
/// projection, head weights and key norm, and a routed expert.
#[test]
fn deepseek_v3_2_yarn_quantized() {
    const INDEXER: &str = "indexer_mismatch";
    check_member(
        "v32",
        &["--yarn"],
        &[
            // Block 2 of row 3 (8 Q8_0 blocks a row).
            Fault {
                gguf_reference: true,
                ..fault(
                    "Q4_K_M",
                    "garbage",
                    "blk.0.indexer.attn_k.weight",
                    &["3", "2", "1", "11"],
                    (INDEXER, "garbage_blocks"),
                )
            },
            // Row 7 whole (8 blocks).
            fault(
                "Q8_0",
                "zero-blocks",
                "blk.1.indexer.attn_q_b.weight",
                &["7", "0", "8"],
                (INDEXER, "zeros"),
            ),
            fault(
                "Q4_K_M",
                "scale",
                "blk.1.indexer.attn_q_b.weight",
                &["2"],
                (INDEXER, "scalar_multiple"),
            ),
            // Head 3's weights.
            fault(
                "Q8_0",
                "zero-blocks",
                "blk.2.indexer.proj.weight",
                &["3", "0", "8"],
                (INDEXER, "zeros"),
            ),
            fault(
                "Q4_K_M",
                "zero",
                "blk.0.indexer.k_norm.weight",
                &[],
                (INDEXER, "zeros"),
            ),
            fault(
                "Q4_K_M",
                "swap-experts",
                "blk.2.ffn_gate_exps.weight",
                &["1", "4"],
                EXPERTS,
            ),
        ],
    );
}
