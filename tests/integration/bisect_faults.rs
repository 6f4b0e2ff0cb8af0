//! `glmcheck bisect` against the fault catalogue: every planted fault, at every TP degree where
//! it exists and in f32 and bf16, is located at the stage the catalogue names and given the
//! catalogue's class (the fault matrix, through `glmcheck selftest --faults`: all of them);
//! clean candidates at every TP degree and dtype pass (f16 with vLLM's rescaling also on a model
//! whose residual stream leaves fp16's range); the catalogue lists itself.

use crate::common;

use std::path::Path;

use glmcheck::dtype::Precision;
use glmcheck::exec::faults::inject::{Injection, CATALOGUE};
use glmcheck::model::stages::{stage_names, stage_weights};
use glmcheck::model::Glm5Config;
use glmcheck::weights::{Encoding, GgmlType};

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

/// A tiny Q4_K_M GLM-5 with 8 heads (TP 8 splits them) and 16 indexer heads.
fn tiny(dir: &Path, extra: &[&str]) -> String {
    let out = dir.join("tiny.gguf");
    let mut args = vec!["--quant", "q4_k_m"];
    args.extend(extra);
    common::synth_tiny(&out, &args);
    out.to_str().unwrap().to_string()
}

fn bisect(model: &str, tp: u32, dtype: &str, fault: Option<&str>) -> serde_json::Value {
    let tp = tp.to_string();
    let mut args = vec![
        "bisect", model, "--tokens", TOKENS, "--tp", &tp, "--dtype", dtype, "--json",
    ];
    if let Some(f) = fault {
        args.extend(["--inject", f]);
    }
    verdict_json(&args)
}

/// glmcheck's JSON answer to `args`, which must exit 0 (pass) or 1 (a fault found).
fn verdict_json(args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new(common::glmcheck_bin())
        .args(args)
        .output()
        .unwrap();
    let code = out.status.code().unwrap();
    assert!(
        code == 0 || code == 1,
        "{args:?}: exit {code}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The model's config and the first stage that reads a Q4_K tensor.
fn config_and_first_q4k(model: &str) -> (Glm5Config, Option<String>) {
    let src = common::weight_source(Path::new(model));
    let cfg = src.cfg.clone();
    let q4k = |id| {
        src.tensor_names(id).iter().any(|n| {
            matches!(
                src.files.get(n).map(|t| &t.encoding),
                Some(Encoding::Ggml(GgmlType::Q4_K))
            )
        })
    };
    let first = stage_names(&cfg)
        .into_iter()
        .find(|s| stage_weights(&cfg, s).into_iter().any(q4k));
    (cfg, first)
}

/// `glmcheck selftest --faults MODEL` at one TP degree: its cases as JSON.
fn fault_matrix(model: &str, tp: u32, dtypes: &str, only: &[&str]) -> Vec<serde_json::Value> {
    let tp = tp.to_string();
    let mut args = vec![
        "selftest", "--faults", model, "--tp", &tp, "--dtype", dtypes, "--json",
    ];
    let only = only.join(",");
    if !only.is_empty() {
        args.extend(["--fault", &only]);
    }
    verdict_json(&args)["cases"].as_array().unwrap().clone()
}

/// Through `selftest --faults` (the fault matrix glmcheck runs on any backend): every fault at
/// TP 1 (those without TP), 2, 4 and 8 in f32 and bf16, fp16-overflow in f16 on a model whose
/// residual stream leaves fp16's range, each with the catalogue's class at its stage; the clean
/// candidates pass.
#[test]
fn the_fault_matrix_names_stage_and_class() {
    let dir = common::scratch();
    let model = tiny(dir.path(), &[]);
    let hot = {
        let d = dir.path().join("hot");
        std::fs::create_dir_all(&d).unwrap();
        tiny(&d, &["--fp16-overflow", "1"])
    };
    let (cfg, first_q4k) = config_and_first_q4k(&model);
    let hot_cfg = config_and_first_q4k(&hot).0;
    assert_eq!(first_q4k.as_deref(), Some("embed"), "token_embd is Q4_K");
    let mut cases = Vec::new();
    for tp in [1, 2, 4, 8] {
        cases.extend(fault_matrix(&model, tp, "f32,bf16", &[]));
        cases.extend(fault_matrix(&hot, tp, "f16", &["fp16-overflow"]));
    }
    // The faults of expert groups need a model that limits them (GLM-5 has one group): the
    // family's matrix below plants them.
    let applies = |e: &&glmcheck::exec::faults::inject::Entry| {
        let dtype = Precision::from_name(e.dtype.unwrap_or("f32")).unwrap();
        let hot = if e.dtype.is_some() { &hot_cfg } else { &cfg };
        Injection::parse(e.name)
            .unwrap()
            .check(hot, 8, dtype)
            .is_ok()
    };
    let planted = CATALOGUE
        .iter()
        .filter(applies)
        .map(|e| (if e.needs_tp { 3 } else { 4 }) * if e.dtype.is_some() { 1 } else { 2 })
        .sum::<usize>();
    assert_eq!(
        cases.len(),
        planted + 4 * 2,
        "every fault and a clean run per TP and dtype"
    );
    let mut table = Vec::new();
    for c in &cases {
        let name = c["fault"].as_str().unwrap();
        // The command's expectations are the library's: check them against the catalogue too.
        if name != "clean" {
            let fault = Injection::parse(name.split('=').next().unwrap()).unwrap();
            assert_eq!(c["expected_class"], fault.entry().class.name());
            let expected = fault.expected_stages(&cfg, first_q4k.as_deref());
            assert_eq!(c["expected_stages"], serde_json::json!(expected), "{name}");
        }
        table.push(format!(
            "{name:<22} {:<5} {:<22} {:<20} {}",
            c["dtype"].as_str().unwrap(),
            c["stage"].as_str().unwrap_or("-"),
            c["class"].as_str().unwrap_or("-"),
            if c["ok"] == true { "ok" } else { "MISSED" }
        ));
    }
    let right = cases.iter().filter(|c| c["ok"] == true).count();
    println!("{}", table.join("\n"));
    println!(
        "{right} of {} located and classified as the catalogue says",
        cases.len()
    );
    assert_eq!(right, cases.len(), "{}", table.join("\n"));
}

/// The family's own faults and the rest of the catalogue on every other member (Q4_K_M GGUFs
/// of `synth --family`, TP 2, f32 and bf16): each planted fault that exists on the member is
/// located and classed, the clean runs pass; the expert-group faults exist on DeepSeek-V2 (groups
/// ranked by their best score) and V3 (by their two best) and are planted there, YaRN's mscale²
/// left out of the softmax scale on the members with YaRN (V3, V3.2, Kimi-K2).
#[test]
fn the_fault_matrix_holds_on_every_member_of_the_family() {
    let dir = common::scratch();
    let mut missed = Vec::new();
    let (mut grouped, mut yarn) = (0, 0);
    for family in [
        "deepseek-v2",
        "deepseek-v2-lite",
        "deepseek-v3",
        "deepseek-v3.2",
        "kimi-k2",
        "glm-4.7-flash",
    ] {
        let model = dir.path().join(format!("{family}.gguf"));
        common::synth_tiny(&model, &["--family", family, "--quant", "q4_k_m"]);
        let cases = fault_matrix(model.to_str().unwrap(), 2, "f32,bf16", &[]);
        assert!(cases.len() > 20, "{family}: {} cases", cases.len());
        for c in &cases {
            let name = c["fault"].as_str().unwrap();
            grouped += usize::from(name.starts_with("group-"));
            yarn += usize::from(name == "yarn-mscale-dropped");
            if c["ok"] != true {
                missed.push(format!("{family} {name} {}: {c}", c["dtype"]));
            }
        }
    }
    assert!(missed.is_empty(), "{}", missed.join("\n"));
    assert_eq!(
        grouped,
        2 * 2 * 3,
        "two group faults, two dtypes, V2, V3 and V3.2"
    );
    assert_eq!(yarn, 2 * 3, "two dtypes, V3, V3.2 and Kimi-K2");
}

/// Another expert choice is named by the way of routing that gives it: the reference's router
/// logits routed again with each common router fault, held to the candidate's ids at every
/// position; ways this prompt cannot tell apart (on a tiny DeepSeek-V3, groups of two experts
/// ranked by their best score keep the two best experts, as no limit does) are named together.
#[test]
fn another_expert_choice_is_named_by_the_way_of_routing_that_gives_it() {
    let dir = common::scratch();
    for (family, fault, says) in [
        ("deepseek-v2", "group-limit-ignored", "every expert group competing: the group limit (the best 1 of 4 groups) left out"),
        ("deepseek-v2", "group-score-swapped", "groups ranked by the sum of their two best scores where the model takes their best"),
        ("deepseek-v3", "router-softmax", "softmax scores where the model takes sigmoid"),
        ("deepseek-v3", "group-limit-ignored", "every expert group competing: the group limit (the best 2 of 4 groups) left out, or with groups ranked by their best score where the model sums their two best (this prompt does not tell them apart)"),
    ] {
        let model = dir.path().join(format!("{family}.gguf"));
        if !model.exists() {
            common::synth_tiny(&model, &["--family", family]);
        }
        let j = bisect(model.to_str().unwrap(), 1, "f32", Some(fault));
        let f = &j["fault"];
        assert_eq!(f["class"], "router_mismatch", "{family} {fault}: {j:#}");
        assert_eq!(
            f["summary"],
            format!("L1.moe.topk_ids: the router chooses as with {says}"),
            "{family} {fault}"
        );
        assert!(
            f["evidence"].to_string().contains("give the candidate's choices at all"),
            "{family} {fault}: {f:#}"
        );
    }
}

/// Another DSA key choice, named by the rotation that gives it: GLM-5's indexer (adjacent pairs)
/// turning NeoX halves, and DeepSeek-V3.2's (NeoX halves) turning adjacent pairs, the bug its
/// indexer met in several engines.
#[test]
fn another_dsa_choice_is_named_by_the_rotation_that_gives_it() {
    let dir = common::scratch();
    for (family, says) in [
        (
            "glm5",
            "rotated in NeoX halves where the model turns adjacent pairs",
        ),
        (
            "deepseek-v3.2",
            "rotated in adjacent pairs where the model turns NeoX halves",
        ),
    ] {
        let model = dir.path().join(format!("{family}.gguf"));
        common::synth_tiny(&model, &["--family", family]);
        let j = bisect(model.to_str().unwrap(), 1, "f32", Some("indexer-rope-neox"));
        let f = &j["fault"];
        assert_eq!(f["class"], "indexer_mismatch", "{family}: {j:#}");
        let summary = f["summary"].as_str().unwrap();
        assert!(
            summary.starts_with(
                "L0.attn.index_topk: the DSA indexer chooses as with its query and key"
            ) && summary.contains(says),
            "{family}: {summary}"
        );
    }
}

/// In bf16 at TP 2 the candidate breaks near ties its own way (or takes the reference's choice
/// there): a hypothesis still names the choice where it holds every other position.
#[test]
fn another_choice_in_bf16_is_named_beside_its_near_ties() {
    let dir = common::scratch();
    for (family, fault, says) in [
        ("deepseek-v3", "router-softmax", "L1.moe.topk_ids: the router chooses as with softmax scores where the model takes sigmoid"),
        ("glm5", "indexer-rope-neox", "L0.attn.index_topk: the DSA indexer chooses as with its query and key rotated in NeoX halves where the model turns adjacent pairs"),
    ] {
        let model = dir.path().join(format!("{family}.gguf"));
        common::synth_tiny(&model, &["--family", family]);
        let j = bisect(model.to_str().unwrap(), 2, "bf16", Some(fault));
        let f = &j["fault"];
        assert_eq!(f["summary"], says, "{family} {fault}: {j:#}");
        let evidence = f["evidence"].to_string();
        assert!(
            evidence.contains("give the candidate's choices at"),
            "{family} {fault}: {evidence}"
        );
    }
}

#[test]
fn clean_candidates_pass_at_every_degree_and_dtype() {
    let dir = common::scratch();
    let model = tiny(dir.path(), &[]);
    for tp in [1, 2, 4, 8] {
        for dtype in ["f32", "bf16", "f16"] {
            let j = bisect(&model, tp, dtype, None);
            assert_eq!(j["verdict"], "pass", "TP {tp} {dtype}: {:#}", j["fault"]);
            assert!(j["first_divergence"].is_null());
            if dtype != "f32" {
                // Judged against the reference re-run at that dtype.
                assert!(j["bisect"]["envelope"].is_string(), "TP {tp} {dtype}");
                assert_eq!(j["fault"]["class"], "precision_loss");
            } else {
                assert!(j["fault"].is_null(), "TP {tp}: {:#}", j["fault"]);
            }
        }
    }
    // A model whose residual stream leaves fp16's range: f16 with vLLM's rescaling passes.
    let hot_dir = dir.path().join("hot");
    std::fs::create_dir_all(&hot_dir).unwrap();
    let hot = tiny(&hot_dir, &["--fp16-overflow", "1"]);
    for tp in [1, 2, 4, 8] {
        let j = bisect(&hot, tp, "f16", None);
        assert_eq!(j["verdict"], "pass", "hot TP {tp} f16: {:#}", j["fault"]);
    }
}

/// Expert parallelism: routed experts whole on their owning rank, each rank's routed partial
/// the sum of its own experts; equal to the reference up to summation order.
#[test]
fn expert_parallel_candidates_pass() {
    let dir = common::scratch();
    let model = tiny(dir.path(), &[]);
    for tp in ["2", "4", "8"] {
        for dtype in ["f32", "bf16"] {
            let j = common::glmcheck_json(
                [
                    "bisect", &model, "--tokens", TOKENS, "--tp", tp, "--ep", "--dtype", dtype,
                    "--json",
                ],
                0,
            );
            assert_eq!(j["verdict"], "pass", "EP {tp} {dtype}: {:#}", j["fault"]);
        }
    }
    // The parts are the owners' sums: a rank whose experts no token chose holds zeros.
    let trace = dir.path().join("ep.trace");
    common::glmcheck_json(
        [
            "run",
            &model,
            "--tokens",
            "1,2,3",
            "--tp",
            "4",
            "--ep",
            "--full",
            "**",
            "--json",
            "--out",
            trace.to_str().unwrap(),
        ],
        0,
    );
    let t = glmcheck::trace::Trace::open(&trace).unwrap();
    let ids = t.tensor("L1.moe.topk_ids", None).unwrap().unwrap();
    for rank in 0..4u32 {
        let owns = |e: f32| (e as u32) / 2 == rank; // 8 experts over 4 ranks
        let part = t.stage("L1.moe.routed", Some(rank)).unwrap();
        assert_eq!(
            part.stats.l2 > 0.0,
            ids.iter().any(|&e| owns(e)),
            "rank {rank}"
        );
    }
}

#[test]
fn the_drill_down_gives_evidence_from_weights_and_shards() {
    let dir = common::scratch();
    let model = tiny(dir.path(), &[]);
    let j = bisect(&model, 4, "f32", Some("unsharded-column"));
    assert_eq!(j["bisect"]["classified_by"], "drill-down");
    // Replayed from the reference's input to layer 0, the stage still diverges: made there.
    let replay = &j["bisect"]["replay"];
    assert_eq!(
        (&replay["from"], &replay["stage"], &replay["status"]),
        (&"layer 0".into(), &"L0.attn.kv".into(), &"fail".into())
    );
    assert_eq!(
        j["fault"]["weight"],
        "model.layers.0.self_attn.kv_b_proj.weight"
    );
    // 8 heads × (32 + 32) rows; rank 3 should hold the last quarter.
    let evidence = j["fault"]["evidence"].to_string();
    assert!(
        evidence.contains("rank 3 holds rows 0..128 of 512")
            && evidence.contains("the plan gives rows 384..512"),
        "{evidence}"
    );
    let j = bisect(&model, 1, "f32", Some("dequant-q4k-scales"));
    assert_eq!(j["fault"]["class"], "wrong_dequant");
    let evidence = j["fault"]["evidence"].to_string();
    // Sub-blocks 4–7 of a 256-block: the first difference is at element 128 or later.
    assert!(evidence.contains("token_embd.weight (Q4_K)"), "{evidence}");
    let position: u64 = evidence
        .split("position ")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(position >= 128, "{evidence}");
    let j = bisect(&model, 1, "f32", Some("kv-b-split-order"));
    assert_eq!(j["fault"]["class"], "weight_layout");
    assert!(j["fault"]["evidence"].to_string().contains("rows moved"));
}

#[test]
fn the_catalogue_lists_every_fault_with_class_and_stage() {
    let j = common::glmcheck_json(["bisect", "--list-faults", "--json"], 0);
    let names: Vec<&str> = j
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    for want in [
        "unsharded-column",
        "shard-axis",
        "rank-order",
        "skip-all-reduce",
        "double-all-reduce",
        "dequant-q4k-scales",
        "fp16-overflow",
        "rope-neox",
        "indexer-rope-neox",
        "router-softmax",
        "routed-scale-twice",
        "group-limit-ignored",
        "group-score-swapped",
        "yarn-mscale-dropped",
        "kv-b-split-order",
        "flat-lm-head",
        "nan-expert",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    assert!(j.as_array().unwrap().iter().all(|e| e["class"].is_string()));
    // An unknown fault is a usage error that points to the listing.
    let out = std::process::Command::new(common::glmcheck_bin())
        .args(["bisect", "x.gguf", "--inject", "no-such-fault"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--list-faults"));
}

/// `--mode logits`: judged by its logits alone, the candidate's first faulty block is found by
/// hybrid runs (the candidate up to a block, the reference after it) in O(log L) runs.
#[test]
fn logits_mode_finds_the_first_faulty_layer_by_hybrid_runs() {
    let dir = common::scratch();
    let model = tiny(dir.path(), &[]);
    let cases = [
        ("rope-neox", 1, "L0.out"),
        ("skip-all-reduce=2", 2, "L2.out"),
        ("nan-expert=2", 1, "L2.out"),
        ("routed-scale-twice", 1, "L1.out"),
        ("dequant-q4k-scales", 1, "embed"),
        ("flat-lm-head", 1, "logits"),
    ];
    for (fault, tp, block) in cases {
        let tp_arg = tp.to_string();
        let j = common::glmcheck_json(
            [
                "bisect", &model, "--tokens", TOKENS, "--tp", &tp_arg, "--inject", fault, "--mode",
                "logits", "--json",
            ],
            1,
        );
        assert_eq!(j["first_divergence"]["stage"], block, "{fault}");
        // Only the logits are compared.
        let stages = j["stages"].as_array().unwrap();
        assert_eq!(stages.len(), 1, "{fault}");
        assert_eq!(stages[0]["stage"], "logits");
        // 3 layers: 5 blocks, so the whole candidate and at most ⌈log2 5⌉ = 3 hybrids.
        let runs = j["bisect"]["hybrids"].as_array().unwrap();
        assert!(runs.len() <= 4, "{fault}: {runs:?}");
    }
    let j = common::glmcheck_json(
        [
            "bisect", &model, "--tokens", TOKENS, "--dtype", "bf16", "--mode", "logits", "--json",
        ],
        0,
    );
    assert_eq!(j["verdict"], "pass");
}
