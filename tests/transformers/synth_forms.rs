//! Synthetic models against the oracles: transformers loads and runs every HF form, the model
//! predicts its built-in pattern with low entropy, the fp16-overflow knob overflows fp16 without
//! changing f32 predictions, the GGUF and HF forms of one seed hold the same weights, gguf-py
//! reads the GGUF, and the same seed gives the same bytes.

use crate::common;
use crate::run_deepseek_classes::{assert_logits_agree, hf_logits};

use std::path::Path;
use std::process::Command;

use glmcheck::model::kv_b::{assemble_kv_b, KvBDims};
use glmcheck::model::names::{LayerWeight, WeightId};
use glmcheck::model::schema::ExpertForm;
use glmcheck::synth::{Massive, Mix, Preset, SynthFamily, SynthSpec};
use glmcheck::weights::ModelFiles;
use serde_json::Value as Json;

/// Run a glmcheck command that must succeed.
fn glmcheck_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn tiny(seed: u64) -> SynthSpec {
    SynthSpec::new(Preset::Tiny.config(), seed)
}

/// transformers' forward of `folder` on `tokens`.
fn hf_forward(folder: &Path, tokens: &[u32]) -> Json {
    let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
    serde_json::from_str(&common::run_oracle(
        "hf.forward",
        &[folder.to_str().unwrap(), &ids.join(",")],
    ))
    .unwrap()
}

/// "The capital of France is", then the pattern's own continuation up to `n` tokens, so every
/// position has a known next token.
fn pattern_tokens(spec: &SynthSpec, n: usize) -> Vec<u32> {
    let next = spec.next_token();
    let mut t = spec.tokenizer().unwrap().encode("The capital of France is");
    while t.len() < n {
        t.push(next[*t.last().unwrap() as usize]);
    }
    t
}

#[test]
fn the_pattern_continues_the_corpus() {
    let spec = tiny(0);
    let tok = spec.tokenizer().unwrap();
    let prompt = tok.encode("The capital of France is");
    let next = spec.next_token();
    let mut text = prompt.clone();
    while text.len() < prompt.len() + 5 {
        text.push(next[*text.last().unwrap() as usize]);
    }
    assert_eq!(tok.decode(&text), "The capital of France is Paris. The");
}

fn assert_predicts_pattern(spec: &SynthSpec, run: &Json, tokens: &[u32]) {
    assert_eq!(run["class"], spec.cfg.member.architecture());
    assert_eq!(run["finite"], true);
    let next = spec.next_token();
    let argmax: Vec<u32> = run["argmax"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let want: Vec<u32> = tokens.iter().map(|&t| next[t as usize]).collect();
    assert_eq!(
        argmax, want,
        "transformers' top-1 follows the built-in pattern"
    );
    let ln_v = run["ln_vocab"].as_f64().unwrap();
    for (i, e) in run["entropy"].as_array().unwrap().iter().enumerate() {
        assert!(
            e.as_f64().unwrap() < 0.1 * ln_v,
            "position {i}: entropy {e} is not far below ln V = {ln_v}"
        );
    }
}

#[test]
fn transformers_runs_both_hf_layouts_and_predicts_the_pattern() {
    let dir = common::scratch();
    let spec = tiny(11);
    // Longer than index_topk, so the DSA indexer really selects.
    let tokens = pattern_tokens(&spec, 12);
    assert!(tokens.len() as u64 > spec.cfg.index_topk);
    let forms = [
        ("per-expert", ExpertForm::PerExpert, Mix::F32),
        ("fused", ExpertForm::FusedGateUp, Mix::F32),
        ("bf16", ExpertForm::PerExpert, Mix::Bf16),
    ];
    for (name, experts, mix) in forms {
        let folder = dir.path().join(name);
        let spec = SynthSpec {
            mix,
            ..spec.clone()
        };
        spec.write_hf(&folder, experts).unwrap();
        assert_predicts_pattern(&spec, &hf_forward(&folder, &tokens), &tokens);
        let report = common::glmcheck_json(
            [
                std::ffi::OsStr::new("inspect"),
                "--json".as_ref(),
                folder.as_os_str(),
            ],
            0,
        );
        assert_eq!(
            report["schema"]["ok"], true,
            "{name}: {:#}",
            report["schema"]
        );
    }
}

/// `synth --family`'s Hugging Face form of every member is what that member's transformers
/// class loads (Kimi-K2's `kimi_k2` through DeepSeek-V3's class, as engines map it): it predicts
/// the pattern there, and glmcheck's logits of it agree with transformers' within 1e-4 ×
/// max|logit|.
#[test]
fn every_member_s_hf_form_runs_in_its_own_transformers_class() {
    let dir = common::scratch();
    for family in SynthFamily::ALL {
        let spec = SynthSpec::new(family.apply(Preset::Tiny.config()), 13);
        let folder = dir.path().join(family.name());
        spec.write_hf(&folder, ExpertForm::PerExpert).unwrap();
        let tokens = pattern_tokens(&spec, 12);
        assert_predicts_pattern(&spec, &hf_forward(&folder, &tokens), &tokens);
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let ids = ids.join(",");
        let (theirs, _) = hf_logits(&folder, &ids);
        let trace = dir.path().join(format!("{}.trace", family.name()));
        common::glmcheck_json(
            [
                "run",
                folder.to_str().unwrap(),
                "--tokens",
                &ids,
                "--json",
                "--out",
                trace.to_str().unwrap(),
            ],
            0,
        );
        let ours = glmcheck::trace::Trace::open(&trace)
            .unwrap()
            .tensor("logits", None)
            .unwrap()
            .unwrap();
        assert_logits_agree(family.name(), &ours, &theirs);
    }
}

#[test]
fn fp16_overflow_knob_leaves_f32_predictions_alone() {
    let dir = common::scratch();
    let plain = tiny(12);
    let mut massive = tiny(12);
    let layer = 1;
    massive.massive = Some(Massive {
        layer,
        value: Massive::DEFAULT_VALUE,
    });
    let tokens = pattern_tokens(&plain, 8);
    let run = |spec: &SynthSpec, name: &str| {
        let folder = dir.path().join(name);
        spec.write_hf(&folder, ExpertForm::PerExpert).unwrap();
        hf_forward(&folder, &tokens)
    };
    let (a, b) = (run(&plain, "plain"), run(&massive, "massive"));
    assert_predicts_pattern(&massive, &b, &tokens);
    assert_eq!(a["argmax"], b["argmax"]);
    let absmax = |r: &Json, l: usize| r["absmax_after_layer"][l].as_f64().unwrap();
    for l in 0..plain.cfg.num_hidden_layers as usize - 1 {
        assert!(
            absmax(&a, l) < 100.0,
            "plain model, layer {l}: {}",
            absmax(&a, l)
        );
        let over = absmax(&b, l) > 65504.0;
        assert_eq!(
            over,
            l as u64 >= layer,
            "massive model, layer {l}: |h| = {}",
            absmax(&b, l)
        );
        // vLLM divides the residual stream by routed_scaling_factor (2.5) in fp16: that fits.
        assert!(absmax(&b, l) / plain.cfg.routed_scaling_factor < 65504.0);
    }
}

/// The GGUF (f32) and HF forms of one seed hold the same values, after name mapping and kv_b
/// assembly; stacked GGUF experts equal the HF per-expert tensors.
#[test]
fn gguf_and_hf_forms_hold_the_same_weights() {
    let dir = common::scratch();
    let spec = tiny(13);
    let (gguf_path, hf_path) = (dir.path().join("m.gguf"), dir.path().join("hf"));
    spec.write_gguf(&gguf_path).unwrap();
    spec.write_hf(&hf_path, ExpertForm::PerExpert).unwrap();
    let (gguf, hf) = (
        ModelFiles::open(&gguf_path).unwrap(),
        ModelFiles::open(&hf_path).unwrap(),
    );
    let cfg = &spec.cfg;
    let dims = KvBDims {
        heads: cfg.num_attention_heads as usize,
        kv_lora: cfg.kv_lora_rank as usize,
        nope: cfg.qk_nope_head_dim as usize,
        v: cfg.v_head_dim as usize,
    };
    let g = |name: String| gguf.dequantize(gguf.require(&name).unwrap()).unwrap();
    for t in hf.tensors() {
        let id =
            WeightId::from_hf(&t.name).unwrap_or_else(|| panic!("{} has no GLM-5 role", t.name));
        let from_gguf = match id {
            WeightId::Layer(l, LayerWeight::KvB) => {
                let part = |w| g(WeightId::Layer(l, w).gguf_name());
                assemble_kv_b(&part(LayerWeight::KB), &part(LayerWeight::VB), dims).unwrap()
            }
            WeightId::Expert {
                layer,
                expert,
                which,
            } => {
                let stacked = gguf
                    .require(&WeightId::Layer(layer, which).gguf_name())
                    .unwrap();
                gguf.dequantize_expert(stacked, expert).unwrap()
            }
            id => g(id.gguf_name()),
        };
        let from_hf = hf.dequantize(t).unwrap();
        assert!(
            from_hf
                .iter()
                .zip(&from_gguf)
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && from_hf.len() == from_gguf.len(),
            "{}",
            t.name
        );
    }
}

#[test]
fn quant_overrides_win_over_the_mix() {
    let dir = common::scratch();
    let out = dir.path().join("o.gguf");
    let args = [
        "synth",
        "--quant",
        "q4_k_m",
        "--quant",
        "*attn_k_b*=Q8_0",
        "--quant",
        "blk.1.*exps*=IQ2_XXS",
        "--out",
    ];
    glmcheck_ok(Command::new(common::glmcheck_bin()).args(args).arg(&out));
    let files = ModelFiles::open(&out).unwrap();
    for t in files.tensors() {
        if t.name.contains("attn_k_b") {
            assert_eq!(t.encoding.name(), "Q8_0", "{}", t.name);
        }
        if t.name.starts_with("blk.1.") && t.name.contains("_exps") {
            // IQ2_XXS needs whole 256-blocks; 128-long down_exps rows fall back as llama.cpp does.
            let want = if t.row_len() % 256 == 0 {
                "IQ2_XXS"
            } else {
                "IQ4_NL"
            };
            assert_eq!(t.encoding.name(), want, "{}", t.name);
        }
        // Every tensor, the random IQ2_XXS blocks included, dequantizes to finite values.
        assert!(
            files.dequantize(t).unwrap().iter().all(|x| x.is_finite()),
            "{}",
            t.name
        );
    }
}

#[test]
fn same_seed_same_bytes_whatever_the_thread_count() {
    let dir = common::scratch();
    let write = |threads: &str, name: &str, format: &str| {
        let out = dir.path().join(name);
        glmcheck_ok(
            Command::new(common::glmcheck_bin())
                .env("RAYON_NUM_THREADS", threads)
                .args([
                    "synth", "--seed", "4", "--quant", "q4_k_m", "--format", format, "--out",
                ])
                .arg(&out),
        );
        out
    };
    let a = std::fs::read(write("1", "a.gguf", "gguf")).unwrap();
    let b = std::fs::read(write("2", "b.gguf", "gguf")).unwrap();
    assert!(a == b, "GGUF bytes differ between 1 and 2 threads");
    let mut spec = tiny(4);
    spec.mix = Mix::Bf16;
    let (x, y) = (dir.path().join("x"), dir.path().join("y"));
    spec.write_hf(&x, ExpertForm::PerExpert).unwrap();
    spec.write_hf(&y, ExpertForm::PerExpert).unwrap();
    for f in ["model.safetensors", "config.json"] {
        assert_eq!(
            std::fs::read(x.join(f)).unwrap(),
            std::fs::read(y.join(f)).unwrap(),
            "{f}"
        );
    }
}

/// gguf-py reads every quant mix; its dequantization of the quantized forms stays close to the
/// f32 form (within each mix's quantization noise).
#[test]
fn gguf_py_reads_every_mix_close_to_f32() {
    let dir = common::scratch();
    let reference = dir.path().join("f32.gguf");
    tiny(14).write_gguf(&reference).unwrap();
    for (mix, bound) in [
        (Mix::Bf16, 0.01),
        (Mix::Q8_0, 0.02),
        (Mix::Q4KM, 0.15),
        (Mix::UdIq, 0.15),
    ] {
        let path = dir.path().join(format!("{mix:?}.gguf"));
        let mut spec = tiny(14);
        spec.mix = mix;
        spec.write_gguf(&path).unwrap();
        let out = common::run_oracle(
            "formats.compare_gguf",
            &[reference.to_str().unwrap(), path.to_str().unwrap()],
        );
        let worst: Json = serde_json::from_str(&out).unwrap();
        assert_eq!(worst["arch"], "glm-dsa");
        let rel = worst["worst_rel_rms"].as_f64().unwrap();
        assert!(
            rel < bound,
            "{mix:?}: worst tensor {} has relative RMS error {rel}",
            worst["worst_tensor"]
        );
    }
}

/// GLM-5.2's shared-indexer schedule from `--set` agrees with transformers' own reading of the
/// same keys.
#[test]
fn indexer_schedule_overrides_match_transformers() {
    use glmcheck::model::config::IndexerKind;
    use glmcheck::synth::preset::apply_overrides;
    let cases = [(4, 3, 12), (2, 0, 7), (1, 2, 5), (3, 1, 10)];
    let kwargs: Vec<Json> = cases
        .iter()
        .map(|(f, o, l)| serde_json::json!({"num_hidden_layers": l, "index_topk_freq": f, "index_skip_topk_offset": o}))
        .collect();
    let out = common::run_oracle("hf.indexer_types", &[&Json::from(kwargs).to_string()]);
    let theirs: Vec<Vec<String>> = serde_json::from_str(&out).unwrap();
    for ((freq, offset, layers), theirs) in cases.into_iter().zip(theirs) {
        let sets = [
            format!("num_hidden_layers={layers}"),
            format!("index_topk_freq={freq}"),
            format!("index_skip_topk_offset={offset}"),
        ];
        let ours = apply_overrides(&Preset::Tiny.config(), &sets)
            .unwrap()
            .indexer_types;
        let ours: Vec<&str> = ours
            .iter()
            .map(|k| {
                if *k == IndexerKind::Full {
                    "full"
                } else {
                    "shared"
                }
            })
            .collect();
        assert_eq!(ours, theirs, "freq {freq} offset {offset} layers {layers}");
    }
}

/// `--quant fp8` is torch's block FP8 quantization of the f32 weights, byte for byte, in
/// GLM-5-FP8's layout: every linear weight FP8 with its scales, the router, the indexer's
/// `weights_proj`, embeddings, `lm_head` and norms BF16; and glmcheck reads it back as those
/// weights dequantized.
#[test]
fn fp8_checkpoint_is_torchs_block_quantization_in_glm5_fp8s_layout() {
    let dir = common::scratch();
    let (plain, fp8) = (dir.path().join("f32"), dir.path().join("fp8"));
    let mut spec = tiny(3);
    spec.write_hf(&plain, ExpertForm::PerExpert).unwrap();
    spec.mix = Mix::Fp8;
    spec.write_hf(&fp8, ExpertForm::PerExpert).unwrap();
    let report: Json = serde_json::from_str(&common::run_oracle(
        "hf.fp8_checkpoint",
        &[plain.to_str().unwrap(), fp8.to_str().unwrap()],
    ))
    .unwrap();
    assert_eq!(report["problems"], Json::Array(vec![]), "{report:#}");
    let names = |k: &str| -> Vec<String> {
        report[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect()
    };
    let (fp8_names, bf16_names) = (names("fp8"), names("bf16"));
    for w in [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.indexer.wq_b.weight",
        "model.layers.0.self_attn.indexer.wk.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
    ] {
        assert!(fp8_names.iter().any(|n| n == w), "{w} not FP8: {report:#}");
    }
    for w in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.0.self_attn.indexer.weights_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ] {
        assert!(
            bf16_names.iter().any(|n| n == w),
            "{w} not BF16: {report:#}"
        );
    }
    let config: Json =
        serde_json::from_str(&std::fs::read_to_string(fp8.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["quant_method"], "fp8");
    assert_eq!(
        config["quantization_config"]["weight_block_size"],
        serde_json::json!([128, 128])
    );
    // Read back: each FP8 weight dequantized within its blocks' E4M3 step of the f32 weight.
    let (a, b) = (
        ModelFiles::open(&plain).unwrap(),
        ModelFiles::open(&fp8).unwrap(),
    );
    for name in &fp8_names {
        let (x, y) = (
            a.dequantize(a.require(name).unwrap()).unwrap(),
            b.dequantize(b.require(name).unwrap()).unwrap(),
        );
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = x
            .iter()
            .zip(&y)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(worst <= amax / 16.0, "{name}: {worst} of {amax}");
        assert!(worst > 0.0, "{name}: read back without FP8 rounding");
    }
}
