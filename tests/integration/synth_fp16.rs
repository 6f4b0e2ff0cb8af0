//! The fp16-overflow knob against the f16 emulation: every op's output stays in fp16's range
//! while the residual stream passes 65504 from the chosen layer on, below 65504 × 2.5 (vLLM's fp16
//! guard holds the stream divided by `routed_scaling_factor`); in f32 the model predicts what it
//! does without the knob; in f16 the guarded run stays finite and the unguarded one
//! (`--inject fp16-overflow`) overflows in the stream of that layer. On a dense and a MoE layer,
//! quantized GGUFs and the HF form.

use crate::common;

use std::path::{Path, PathBuf};

use glmcheck::trace::{ElemType, Trace};
use serde_json::Value as Json;

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";
const FP16_MAX: f64 = 65504.0;
/// The most any one op may output.
const OP_MAX: f64 = 6.0e4;
/// vLLM's fp16 guard divides the stream by GLM-5's routed_scaling_factor.
const ROUTED_SCALING_FACTOR: f64 = 2.5;
/// The knob's default target after its layer.
const VALUE: f64 = 1.1e5;

/// A synthetic model at `dir/name` (`.gguf` unless `--format hf` is among `args`).
fn synth(dir: &Path, name: &str, args: &[&str]) -> PathBuf {
    let hf = args.contains(&"hf");
    let out = dir.join(if hf {
        name.to_string()
    } else {
        format!("{name}.gguf")
    });
    let mut a = vec!["synth", "--preset", "tiny", "--set", "index_n_heads=16"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["--out", out.to_str().unwrap()]);
    common::glmcheck_ok(&a);
    out
}

/// A recorded run of every stage: its trace and the greedy tokens (top-1 per prompt position,
/// then 8 generated).
fn run(model: &Path, name: &str, args: &[&str]) -> (Trace, Vec<u64>) {
    let out = model.with_file_name(format!("{name}.trace"));
    let mut a = vec![
        "run",
        model.to_str().unwrap(),
        "--tokens",
        TOKENS,
        "--generate",
        "8",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ];
    a.extend_from_slice(args);
    let j: Json = serde_json::from_str(&common::glmcheck_ok(&a)).unwrap();
    let ids = |k: &str| -> Vec<u64> {
        j[k].as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    let mut tokens = ids("top1");
    tokens.extend(ids("generated"));
    (Trace::open(&out).unwrap(), tokens)
}

/// `L{n}.attn_resid` or `L{n}.out`: the residual stream after layer n's attention or FFN.
fn stream_stage(name: &str) -> Option<(u64, bool)> {
    let (layer, stage) = name.strip_prefix('L')?.split_once('.')?;
    let after_ffn = match stage {
        "attn_resid" => false,
        "out" => true,
        _ => return None,
    };
    Some((layer.parse().ok()?, after_ffn))
}

/// (a)–(c) on an f32 trace of a model with the knob at `layer`: returns the stream's absmax and
/// the largest op output (stage, absmax).
fn check_ranges(trace: &Trace, layer: u64) -> (f64, (String, f64)) {
    let (mut stream_max, mut op_max) = (0f64, (String::new(), 0f64));
    for s in trace.stages().iter().filter(|s| s.dtype != ElemType::I32) {
        let a = s.stats.absmax;
        assert!(
            s.stats.inf == 0 && s.stats.nan == 0,
            "{} not finite",
            s.name
        );
        match stream_stage(&s.name) {
            Some((n, after_ffn)) => {
                stream_max = stream_max.max(a);
                if n < layer {
                    assert!(a < 100.0, "{}: {a} before the massive layer", s.name);
                } else if n == layer && !after_ffn {
                    // Halfway: the attention step only.
                    assert!(
                        (0.4 * VALUE..FP16_MAX).contains(&a),
                        "{}: {a} between the steps",
                        s.name
                    );
                } else {
                    assert!(a > FP16_MAX, "{}: {a} should be past fp16", s.name);
                    assert!(
                        (a / VALUE - 1.0).abs() < 2e-3,
                        "{}: {a}, not {VALUE}",
                        s.name
                    );
                }
                assert!(
                    a < FP16_MAX * ROUTED_SCALING_FACTOR,
                    "{}: {a} overflows even vLLM's guarded stream",
                    s.name
                );
            }
            None => {
                assert!(a <= OP_MAX, "{} (rank {:?}): op output {a}", s.name, s.rank);
                if a > op_max.1 {
                    op_max = (format!("{}{}", s.name, rank_suffix(s.rank)), a);
                }
            }
        }
    }
    // The two steps are each near half the value.
    assert!(op_max.1 > 0.45 * VALUE, "largest op {op_max:?}");
    (stream_max, op_max)
}

fn rank_suffix(rank: Option<u32>) -> String {
    rank.map(|r| format!("@{r}")).unwrap_or_default()
}

/// The stages holding an Inf or NaN, in order.
fn not_finite(trace: &Trace) -> Vec<String> {
    trace
        .stages()
        .iter()
        .filter(|s| s.stats.inf > 0 || s.stats.nan > 0)
        .map(|s| s.name.clone())
        .collect()
}

/// The whole check for the knob at `layer` on the model `args` make.
fn knob_holds(args: &[&str], layer: u64, f16: bool) {
    let dir = common::scratch();
    let knob = layer.to_string();
    let plain = synth(dir.path(), "plain", args);
    let mut hot_args = args.to_vec();
    hot_args.extend_from_slice(&["--fp16-overflow", &knob]);
    let hot = synth(dir.path(), "hot", &hot_args);

    let (_, plain_tokens) = run(&plain, "plain-f32", &[]);
    let (f32_trace, hot_tokens) = run(&hot, "hot-f32", &["--full", "**"]);
    assert_eq!(
        hot_tokens, plain_tokens,
        "f32 greedy tokens with the knob and without"
    );
    let (stream, op) = check_ranges(&f32_trace, layer);
    eprintln!("{args:?} layer {layer}: stream absmax {stream}, largest op {op:?}");
    // Tensor parallelism records each rank's partial sums: within range too.
    let (tp_trace, tp_tokens) = run(&hot, "hot-f32-tp2", &["--tp", "2"]);
    assert_eq!(tp_tokens, plain_tokens);
    let (_, tp_op) = check_ranges(&tp_trace, layer);
    eprintln!("  at TP 2, largest op {tp_op:?}");

    if !f16 {
        return;
    }
    let (guarded, _) = run(&hot, "hot-f16", &["--dtype", "f16"]);
    assert_eq!(
        not_finite(&guarded),
        Vec::<String>::new(),
        "vLLM's guard keeps f16 finite"
    );
    let (open, _) = run(
        &hot,
        "hot-f16-open",
        &["--dtype", "f16", "--inject", "fp16-overflow"],
    );
    let bad = not_finite(&open);
    assert_eq!(
        bad.first().map(String::as_str),
        Some(format!("L{layer}.out").as_str()),
        "without the guard the stream overflows after layer {layer}'s FFN: {bad:?}"
    );
    let inf_in_stream = open
        .stages()
        .iter()
        .any(|s| s.name == format!("L{layer}.out") && s.stats.inf > 0);
    assert!(inf_in_stream, "Inf in the stream: {bad:?}");
}

#[test]
fn fp16_knob_on_a_moe_layer_of_a_q4_k_m_gguf() {
    // Eight heads make o_proj's rows whole Q4_K blocks.
    knob_holds(
        &["--quant", "q4_k_m", "--set", "num_attention_heads=8"],
        1,
        true,
    );
}

#[test]
fn fp16_knob_on_the_dense_layer_of_a_q8_0_gguf() {
    knob_holds(&["--quant", "q8_0"], 0, true);
}

#[test]
fn fp16_knob_on_the_last_layer_of_a_q4_k_m_gguf_with_q5_0_o_proj() {
    knob_holds(&["--quant", "q4_k_m", "--seed", "3"], 2, true);
}

#[test]
fn fp16_knob_in_the_hf_form() {
    knob_holds(&["--format", "hf", "--quant", "bf16"], 1, true);
    knob_holds(&["--format", "hf"], 0, false);
}
