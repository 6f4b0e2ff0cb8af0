//! The transformers probe (`probes/glmcheck_probe`): on a synthetic GLM-5 folder its trace opens
//! with glmcheck's reader, its logits are transformers' own, its stages agree with one another
//! (final norm, RoPE in pair order), and its statistics are exactly `TensorStats::of`.

use crate::common;

use std::path::Path;
use std::process::Command;

use glmcheck::trace::{ElemType, TensorStats, Trace};
use glmcheck::weights::ModelFiles;
use serde_json::Value as Json;

const TOKENS: &str = "1,5,9,13,200,7,3,88,21,300,4,2";
const T: usize = 12;

/// A synthetic HF folder under `dir` and its config.
fn synth(dir: &Path) -> (std::path::PathBuf, Json) {
    let hf = dir.join("hf");
    let status = Command::new(common::glmcheck_bin())
        .args(["synth", "--format", "hf", "--out"])
        .arg(&hf)
        .status()
        .expect("start glmcheck");
    assert!(status.success(), "glmcheck synth failed");
    let config = serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap());
    (hf, config.unwrap())
}

/// Run the probe on `hf` into `dir/run.trace` with extra arguments; the opened trace.
fn probe(hf: &Path, dir: &Path, extra: &[&str]) -> Trace {
    let out = dir.join("run.trace");
    let run = Command::new(common::python())
        .args(["-m", "glmcheck_probe.transformers_probe"])
        .arg(hf)
        .args(["--tokens", TOKENS, "--out"])
        .arg(&out)
        .args(extra)
        .output()
        .expect("start python");
    assert!(
        run.status.success(),
        "probe failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    Trace::open(&out).expect("the probe's trace opens with glmcheck's reader")
}

fn f32s(trace: &Trace, name: &str) -> Vec<f32> {
    trace
        .tensor(name, None)
        .unwrap()
        .unwrap_or_else(|| panic!("{name} not stored in full"))
}

/// Whether `name` is a docs/design.md §4 stage name.
fn design_name(name: &str) -> bool {
    if ["embed", "final_norm", "logits"].contains(&name) {
        return true;
    }
    let Some((layer, stage)) = name.split_once('.') else {
        return false;
    };
    let number = &layer[1..];
    layer.starts_with('L')
        && !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit())
        && glmcheck::model::stages::LAYER_STAGES.contains(&stage)
}

fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1f64, |m, w| m.max(w.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol * scale,
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn probe_trace_matches_transformers_and_itself() {
    let dir = common::scratch();
    let (hf, config) = synth(dir.path());
    let trace = probe(&hf, dir.path(), &["--full", "**"]);
    let get = |k: &str| config[k].as_u64().unwrap() as usize;
    let layers = get("num_hidden_layers");
    let m = trace.manifest();
    assert_eq!(
        (m.backend.as_str(), m.dtype.as_str(), m.tp),
        ("transformers", "f32", 1)
    );
    assert_eq!(m.producer["name"], "glmcheck_probe");
    assert!(m.model.fingerprint.starts_with("sha256:"));
    assert_eq!(m.model.config, config);

    // Names, stats recomputed in Rust (exact), whole tensors.
    for s in trace.stages() {
        assert!(
            design_name(&s.name),
            "{} is not a docs/design.md §4 name",
            s.name
        );
        assert_eq!(s.rank, None, "{}", s.name);
        let stats = match s.dtype {
            ElemType::F32 => TensorStats::of(&f32s(&trace, &s.name)),
            ElemType::I32 => TensorStats::of(&trace.tensor_i32(&s.name, None).unwrap().unwrap()),
            ElemType::F64 => panic!("{}: the probe records f32, not f64", s.name),
        };
        assert_eq!(
            stats, s.stats,
            "{}: stats differ from TensorStats::of",
            s.name
        );
    }
    for n in 0..layers {
        for stage in ["attn.q", "attn.kv", "attn.q_rope", "attn.ctx", "out"] {
            assert!(
                trace.stage(&format!("L{n}.{stage}"), None).is_some(),
                "L{n}.{stage}"
            );
        }
    }
    common::run_oracle("trace.check", &[trace.dir().to_str().unwrap()]);

    // Logits: transformers' own from a forward without hooks.
    let oracle: Json = serde_json::from_str(&common::run_oracle(
        "hf.logits",
        &[hf.to_str().unwrap(), TOKENS],
    ))
    .unwrap();
    let want: Vec<f64> = oracle["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(
        trace.stage("logits", None).unwrap().shape,
        [T as u64, get("vocab_size") as u64]
    );
    assert_close("logits", &f32s(&trace, "logits"), &want, 1e-6);

    // final_norm = RMSNorm(L{last}.out) with model.norm.weight.
    let files = ModelFiles::open(&hf).unwrap();
    let w = files
        .dequantize(files.require("model.norm.weight").unwrap())
        .unwrap();
    let eps = config["rms_norm_eps"].as_f64().unwrap();
    let last = f32s(&trace, &format!("L{}.out", layers - 1));
    let norm: Vec<f64> = last
        .chunks(w.len())
        .flat_map(|row| {
            let ms = row.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / row.len() as f64;
            let r = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(&w)
                .map(move |(&x, &g)| f64::from(g) * f64::from(x) * r)
        })
        .collect();
    assert_close("final_norm", &f32s(&trace, "final_norm"), &norm, 1e-5);

    // RoPE parts in pair order: rotating adjacent pairs of the unrotated q / k_pe gives them.
    let (nope, rope, heads) = (
        get("qk_nope_head_dim"),
        get("qk_rope_head_dim"),
        get("num_attention_heads"),
    );
    let theta = config["rope_parameters"]["rope_theta"].as_f64().unwrap();
    let rotate = |x: &[f32], t: usize| -> Vec<f64> {
        (0..rope / 2)
            .flat_map(|i| {
                let angle = t as f64 * theta.powf(-2.0 * i as f64 / rope as f64);
                let (a, b) = (f64::from(x[2 * i]), f64::from(x[2 * i + 1]));
                [
                    a * angle.cos() - b * angle.sin(),
                    b * angle.cos() + a * angle.sin(),
                ]
            })
            .collect()
    };
    let kv_width = get("kv_lora_rank") + rope;
    for n in 0..layers {
        let q = f32s(&trace, &format!("L{n}.attn.q"));
        let want_q: Vec<f64> = q
            .chunks(nope + rope)
            .enumerate()
            .flat_map(|(row, head)| rotate(&head[nope..], row / heads))
            .collect();
        assert_close(
            &format!("L{n}.attn.q_rope"),
            &f32s(&trace, &format!("L{n}.attn.q_rope")),
            &want_q,
            1e-5,
        );
        let kv_a = f32s(&trace, &format!("L{n}.attn.kv_a"));
        let want_k: Vec<f64> = kv_a
            .chunks(kv_width)
            .enumerate()
            .flat_map(|(t, row)| rotate(&row[kv_width - rope..], t))
            .collect();
        assert_close(
            &format!("L{n}.attn.k_rope"),
            &f32s(&trace, &format!("L{n}.attn.k_rope")),
            &want_k,
            1e-5,
        );
    }

    // Ids: experts below n_routed_experts; DSA keys at or before the query, or -1.
    let experts = get("n_routed_experts") as i32;
    let mut moe_layers = 0;
    for n in 0..layers {
        if let Some(s) = trace.stage(&format!("L{n}.moe.topk_ids"), None) {
            moe_layers += 1;
            assert_eq!(s.shape, [T as u64, get("num_experts_per_tok") as u64]);
            let ids = trace.tensor_i32(&s.name, None).unwrap().unwrap();
            assert!(
                ids.iter().all(|&e| (0..experts).contains(&e)),
                "{}: {ids:?}",
                s.name
            );
        }
        let keys = trace
            .tensor_i32(&format!("L{n}.attn.index_topk"), None)
            .unwrap()
            .unwrap();
        let k = keys.len() / T;
        for (i, &key) in keys.iter().enumerate() {
            assert!(
                (-1..=(i / k) as i32).contains(&key),
                "L{n}.attn.index_topk[{i}] = {key}"
            );
        }
    }
    assert_eq!(moe_layers, layers - get("first_k_dense_replace"));
}

#[test]
fn probe_keeps_logits_and_layer_outputs_in_full_by_default() {
    let dir = common::scratch();
    let (hf, _) = synth(dir.path());
    let trace = probe(&hf, dir.path(), &[]);
    for s in trace.stages() {
        let layer_out =
            s.name.starts_with('L') && s.name.ends_with(".out") && s.name.matches('.').count() == 1;
        let want_full = s.name == "logits" || layer_out;
        assert_eq!(s.file.is_some(), want_full, "{}", s.name);
    }
}

/// A one-tensor-per-expert checkpoint (the published form) whose expert 2 gate holds expert 5's
/// rows, run by transformers with the probe's default recording: the routing and the experts'
/// sum are kept as statistics, so the path back from `L1.moe.routed` covers every expert's
/// tensors of the layer, and the path check (`--weights divergent`) names the
/// tensor and the one its rows came from.
#[test]
fn an_expert_copied_in_a_per_expert_checkpoint_is_named_on_the_path() {
    let dir = common::scratch();
    let (reference, _) = synth(dir.path());
    let cand = dir.path().join("cand");
    std::fs::create_dir(&cand).unwrap();
    for entry in std::fs::read_dir(&reference).unwrap() {
        let from = entry.unwrap().path();
        std::fs::copy(&from, cand.join(from.file_name().unwrap())).unwrap();
    }
    let (target, source) = (
        "model.layers.1.mlp.experts.2.gate_proj.weight",
        "model.layers.1.mlp.experts.5.gate_proj.weight",
    );
    common::run_oracle("hf.copy_tensor", &[cand.to_str().unwrap(), target, source]);
    let trace = probe(&cand, dir.path(), &[]);
    let j = common::bisect_candidate(&reference, trace.dir(), &["--weights", "divergent"], 1);
    assert_eq!(
        j["first_divergence"]["stage"], "L1.moe.routed",
        "{:#}",
        j["fault"]
    );
    assert_eq!(j["fault"]["class"], "weight_layout", "{:#}", j["fault"]);
    let b = &j["bisect"];
    assert_eq!(b["classified_by"], "weights", "{b:#}");
    let path_tensors = b["path"]["tensors"].as_array().unwrap();
    assert!(path_tensors.iter().any(|t| t == target), "{:#}", b["path"]);
    let found = &b["weights"]["findings"][0];
    assert_eq!(found["tensor"], target, "{found:#}");
    assert!(
        found["summary"].as_str().unwrap().contains(source),
        "{found:#}"
    );
}
