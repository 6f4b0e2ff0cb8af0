//! The vLLM probe (`probes/glmcheck_probe/vllm_probe.py`) on module trees that carry vLLM's
//! module paths, class names, parameter names and per-rank shard shapes
//! (`tests/oracle/fake_vllm.py`: a synthetic GLM-5 cut as vLLM cuts it, each rank's forward in
//! its own thread). vLLM itself is not installed here. A correct TP 2 tree gives a shard
//! manifest that `shards --actual` passes and a per-rank trace that glmcheck's reader opens and
//! `bisect --candidate` passes against the reference; kv_b_proj left unsharded is
//! `unsharded_weight` from the manifest and from the trace; a renamed class or module makes the
//! probe fail with a message naming it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use glmcheck::trace::{ElemType, TensorStats, Trace};
use serde_json::Value;

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";
const T: u64 = 12;

/// Run the fake vLLM tree on `hf` into `out` with extra arguments.
fn fake_vllm(hf: &Path, out: &Path, extra: &[&str]) -> Output {
    Command::new(common::python())
        .arg(common::root().join("tests/oracle/fake_vllm.py"))
        .arg(hf)
        .arg(out)
        .args(["--tokens", TOKENS])
        .args(extra)
        .output()
        .expect("start python")
}

fn fake_vllm_ok(hf: &Path, out: &Path, extra: &[&str]) {
    let run = fake_vllm(hf, out, extra);
    assert!(
        run.status.success(),
        "fake_vllm.py {extra:?} failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The tiny synthetic model (8 heads, 16 indexer heads) as a Hugging Face folder.
fn synth(dir: &Path) -> PathBuf {
    let hf = dir.join("hf");
    common::synth_tiny(&hf, &["--format", "hf"]);
    hf
}

fn shards(hf: &Path, manifest: &Path, code: i32) -> Value {
    common::glmcheck_json(
        [
            "shards",
            hf.to_str().unwrap(),
            "--actual",
            manifest.to_str().unwrap(),
            "--json",
        ],
        code,
    )
}

/// `bisect MODEL --candidate TRACE` with vLLM's q_a/kv_a norm eps (`rms_norm_eps`).
fn bisect(hf: &Path, trace: &Path, extra: &[&str], code: i32) -> Value {
    let eps = ["--latent-norm-eps", "1e-5"];
    common::bisect_candidate(hf, trace, &[&eps[..], extra].concat(), code)
}

fn manifest_entries(path: &Path) -> Vec<(u64, String, Vec<u64>)> {
    let m: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    m["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| {
            let rank = r["rank"].as_u64().unwrap();
            r["weights"].as_array().unwrap().iter().map(move |w| {
                let shape = w["shape"].as_array().unwrap();
                (
                    rank,
                    w["name"].as_str().unwrap().to_string(),
                    shape.iter().map(|d| d.as_u64().unwrap()).collect(),
                )
            })
        })
        .collect()
}

#[test]
fn a_correct_tp2_tree_passes_the_shard_check_and_bisect() {
    let dir = common::scratch();
    let hf = synth(dir.path());
    let out = dir.path().join("tp2");
    fake_vllm_ok(&hf, &out, &["--tp", "2"]);

    // The manifest: every parameter of both ranks, vLLM's names and local shapes, all as planned.
    let manifest = out.join("shards.json");
    let entries = manifest_entries(&manifest);
    let has = |rank: u64, name: &str, shape: &[u64]| {
        entries
            .iter()
            .any(|(r, n, s)| *r == rank && n == name && s == shape)
    };
    for rank in 0..2 {
        // kv_b [8 heads · (32 + 32), 64] → 4 heads per rank; o_proj [256, 8 · 32] by columns;
        // fused q_a + kv_a [128 + 80, 256] replicated; w13 [8, 2 · 128 / 2, 256].
        assert!(has(
            rank,
            "model.layers.0.self_attn.kv_b_proj.weight",
            &[256, 64]
        ));
        assert!(has(
            rank,
            "model.layers.0.self_attn.o_proj.weight",
            &[256, 128]
        ));
        assert!(has(
            rank,
            "model.layers.0.self_attn.fused_qkv_a_proj.weight",
            &[208, 256]
        ));
        assert!(has(
            rank,
            "model.layers.1.mlp.experts.w13_weight",
            &[8, 128, 256]
        ));
        assert!(has(
            rank,
            "model.layers.1.mlp.experts.w2_weight",
            &[8, 256, 64]
        ));
        assert!(has(
            rank,
            "model.layers.2.self_attn.indexer.wk_weights_proj.weight",
            &[80, 256]
        ));
        assert!(has(rank, "lm_head.weight", &[192, 256]));
    }
    // The MTP layer (model.layers.3) is not in vLLM's main model, nor in the manifest.
    assert!(entries.iter().all(|(_, n, _)| !n.contains("layers.3.")));
    let v = shards(&hf, &manifest, 0);
    assert_eq!(v["verdict"], "pass");
    assert_eq!(v["checked"].as_u64(), Some(entries.len() as u64));
    assert_eq!(v["ok"], v["checked"]);
    assert_eq!(v["not_in_manifest"], Value::Array(vec![]));

    // The trace: glmcheck's reader opens it; split stages hold each rank's part with its dims.
    let trace = Trace::open(&out.join("run.trace")).expect("the merged trace opens");
    let m = trace.manifest();
    assert_eq!(
        (m.backend.as_str(), m.dtype.as_str(), m.tp),
        ("vllm", "f32", 2)
    );
    assert_eq!(m.producer["disagree"], Value::Array(vec![]));
    assert_eq!(m.producer["notes"], Value::Array(vec![]));
    let tokens: Vec<u32> = TOKENS.split(',').map(|t| t.parse().unwrap()).collect();
    assert_eq!(m.tokens, tokens);
    let parts = [
        ("L0.attn.q", "t h(tp) d", vec![T, 4, 48]),
        ("L0.attn.kv", "t h(tp) d", vec![T, 4, 64]),
        ("L0.attn.q_rope", "t h(tp) d", vec![T, 4, 16]),
        ("L0.attn.ctx", "t h(tp) d", vec![T, 4, 32]),
        ("L1.moe.shared", "t d partial(tp)", vec![T, 256]),
    ];
    for (name, dims, shape) in &parts {
        assert!(trace.stage(name, None).is_none(), "{name} whole");
        for rank in 0..2 {
            let s = trace
                .stage(name, Some(rank))
                .unwrap_or_else(|| panic!("{name} {rank}"));
            assert_eq!((s.dims.as_str(), &s.shape), (*dims, shape), "{name} {rank}");
        }
    }
    let wholes = [
        ("embed", "t d", vec![T, 256]),
        ("L0.attn.kv_a", "t d", vec![T, 80]),
        ("L0.attn.k_rope", "t d", vec![T, 16]),
        ("L0.attn.index_topk", "t k", vec![T, 4]),
        ("L0.attn.out", "t d", vec![T, 256]),
        ("L1.moe.router_logits", "t e", vec![T, 8]),
        ("L2.out", "t d", vec![T, 256]),
        ("logits", "t v(tp)", vec![T, 384]),
    ];
    for (name, dims, shape) in &wholes {
        let s = trace.stage(name, None).unwrap_or_else(|| panic!("{name}"));
        assert_eq!((s.dims.as_str(), &s.shape), (*dims, shape), "{name}");
        assert!(trace.stage(name, Some(0)).is_none(), "{name} rank 0");
    }
    // Statistics written by the probe are exactly TensorStats::of of the stored values.
    for s in trace.stages() {
        let stats = match s.dtype {
            ElemType::F32 => TensorStats::of(&trace.tensor(&s.name, s.rank).unwrap().unwrap()),
            ElemType::I32 => TensorStats::of(&trace.tensor_i32(&s.name, s.rank).unwrap().unwrap()),
            ElemType::F64 => panic!("{}: f64", s.name),
        };
        assert_eq!(stats, s.stats, "{} rank {:?}", s.name, s.rank);
    }

    // The per-rank forward agrees with glmcheck's reference stage by stage.
    let j = bisect(&hf, &out.join("run.trace"), &[], 0);
    assert_eq!(j["verdict"], "pass", "{:#}", j["fault"]);
    let compared = j["stages"].as_array().unwrap();
    for name in ["L0.attn.kv", "L0.attn.ctx", "L1.moe.shared", "logits"] {
        let s = compared
            .iter()
            .find(|s| s["stage"] == name)
            .unwrap_or_else(|| panic!("{name} not compared"));
        assert!(s["rel_diff"].as_f64().unwrap() < 1e-10, "{name}: {s}");
    }
}

#[test]
fn kv_b_proj_left_unsharded_is_named_from_the_manifest_and_the_trace() {
    let dir = common::scratch();
    let hf = synth(dir.path());
    let layers = 3;

    // Every rank holds rank 0's block: the manifest check and the trace both name it.
    let same = dir.path().join("same-block");
    fake_vllm_ok(&hf, &same, &["--tp", "2", "--fault", "unshard-kv-b"]);
    let v = shards(&hf, &same.join("shards.json"), 1);
    assert_eq!(v["verdict"], "fail");
    let bad = v["mismatches"].as_array().unwrap();
    assert_eq!(bad.len(), layers, "{bad:#?}");
    for (n, m) in bad.iter().enumerate() {
        assert_eq!(m["class"], "unsharded_weight");
        assert_eq!(
            m["weight"],
            format!("model.layers.{n}.self_attn.kv_b_proj.weight")
        );
        assert_eq!(m["rank"], 1);
        assert_eq!(m["found"], "rows 0..256");
        assert_eq!(m["expected"], "rows 256..512");
    }
    let trace = same.join("run.trace");
    let j = bisect(&hf, &trace, &[], 1);
    assert_eq!(j["first_divergence"]["stage"], "L0.attn.kv");
    assert_eq!(j["fault"]["class"], "unsharded_weight");
    assert_eq!(j["bisect"]["classified_by"], "traces");
    let manifest = same.join("shards.json");
    let j = bisect(&hf, &trace, &["--actual", manifest.to_str().unwrap()], 1);
    assert_eq!(j["fault"]["class"], "unsharded_weight");
    assert_eq!(
        j["fault"]["weight"],
        "model.layers.0.self_attn.kv_b_proj.weight"
    );
    assert_eq!(j["bisect"]["classified_by"], "shard manifest");

    // Every rank holds kv_b_proj whole (its forward cannot run with the wrong head count).
    let whole = dir.path().join("whole");
    fake_vllm_ok(
        &hf,
        &whole,
        &["--tp", "2", "--fault", "whole-kv-b", "--no-forward"],
    );
    let v = shards(&hf, &whole.join("shards.json"), 1);
    let bad = v["mismatches"].as_array().unwrap();
    assert_eq!(bad.len(), 2 * layers, "{bad:#?}");
    for m in bad {
        assert_eq!(m["class"], "unsharded_weight");
        assert_eq!(m["found"], "all");
        assert!(m["weight"]
            .as_str()
            .unwrap()
            .ends_with("self_attn.kv_b_proj.weight"));
    }
    assert_eq!(
        v["ok"].as_u64().unwrap() + 2 * layers as u64,
        v["checked"].as_u64().unwrap()
    );
}

#[test]
fn a_renamed_vllm_makes_the_probe_fail_naming_the_module() {
    let dir = common::scratch();
    let hf = synth(dir.path());
    let cases = [
        (
            "--rename-class",
            "ColumnParallelLinear=ColumnParallelLinearV2",
            "model.layers.0.self_attn.q_b_proj: class ColumnParallelLinearV2 is not one this probe knows",
        ),
        (
            "--rename-module",
            "kv_b_proj=kv_up_proj",
            "model.layers.0.self_attn.kv_up_proj.weight: a parameter this probe does not know",
        ),
        (
            "--rename-class",
            "RotaryEmbedding=MRotaryEmbedding",
            "model.layers.0.self_attn.rotary_emb: class MRotaryEmbedding is not one this probe knows",
        ),
        (
            "--rename-class",
            "FusedMoE=FusedMoEV2",
            "model.layers.1.mlp.experts: class FusedMoEV2 is not one this probe knows",
        ),
    ];
    for (i, (flag, rename, message)) in cases.iter().enumerate() {
        let out = dir.path().join(format!("renamed{i}"));
        let run = fake_vllm(&hf, &out, &["--tp", "2", flag, rename]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{rename}: {stderr}");
        assert!(stderr.contains("UnknownModel"), "{rename}: {stderr}");
        assert!(stderr.contains(message), "{rename}: {stderr}");
        assert!(
            !out.join("run.trace").exists(),
            "{rename}: a trace was written"
        );
    }
}
