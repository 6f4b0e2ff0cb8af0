//! `run --profile` and the trace's `producer.op_seconds`: every backend op of the recorded pass
//! counted once per call (norms, attention, stages as the forward makes them), the warm-up
//! passes left out, and the ops' time within the pass's wall time.

use crate::common;

use std::collections::BTreeMap;

use glmcheck::trace::Trace;

const TOKENS: &str = "39,100,7,200,5";

/// `run --profile --json` of `model` with `warm_up` unrecorded passes: the profile's calls per
/// op, its pass seconds, and the trace.
fn profiled(
    model: &str,
    warm_up: &str,
    out: &std::path::Path,
) -> (BTreeMap<String, u64>, f64, Trace) {
    let printed = common::glmcheck_json(
        [
            "run",
            model,
            "--tokens",
            TOKENS,
            "--warm-up",
            warm_up,
            "--profile",
            "--json",
            "--out",
            out.to_str().unwrap(),
        ],
        0,
    );
    let profile = &printed["profile"];
    let calls = profile["ops"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["op"].as_str().unwrap().to_string(),
                o["calls"].as_u64().unwrap(),
            )
        })
        .collect();
    (
        calls,
        profile["pass_seconds"].as_f64().unwrap(),
        Trace::open(out).unwrap(),
    )
}

#[test]
fn the_profile_counts_every_op_of_the_recorded_pass() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    common::synth_tiny(&model, &["--quant", "q4_k_m"]);
    let model = model.to_str().unwrap();
    let (cold, cold_seconds, trace) = profiled(model, "0", &dir.path().join("cold.trace"));
    let layers = trace.manifest().model.config["num_hidden_layers"]
        .as_u64()
        .unwrap();
    // Per layer attn_norm, q_a and kv_a norms and the FFN's norm; then the final norm.
    assert_eq!(cold["rms_norm"], 4 * layers + 1);
    assert_eq!(cold["attention"], layers);
    assert_eq!(cold["indexer_scores"], layers);
    // The host's own steps: the cache grown once per layer, the experts chosen once per MoE
    // layer.
    assert_eq!(cold["host: kv cache"], layers);
    let dense = trace.manifest().model.config["first_k_dense_replace"]
        .as_u64()
        .unwrap();
    assert_eq!(cold["host: route"], layers - dense);
    // One record call per stage the trace lists.
    assert_eq!(cold["record"], trace.stages().len() as u64);
    // The weights are read and held in this pass.
    assert!(cold["hold_stored"] > 0);

    let producer = &trace.manifest().producer;
    let recorded: BTreeMap<String, u64> = producer["op_seconds"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(op, v)| (op.clone(), v["calls"].as_u64().unwrap()))
        .collect();
    assert_eq!(recorded, cold, "the trace keeps what --profile prints");
    let layer_seconds: f64 = producer["layer_seconds"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| !k.contains('.'))
        .map(|(_, v)| v.as_f64().unwrap())
        .sum();
    assert!(layer_seconds <= cold_seconds);
    assert_eq!(producer["pass_seconds"].as_f64(), Some(cold_seconds));

    // After a warm-up pass the weights are kept: the recorded pass holds none, and otherwise
    // calls the same ops as often.
    let (warm, warm_seconds, warm_trace) = profiled(model, "1", &dir.path().join("warm.trace"));
    let unheld: BTreeMap<String, u64> = cold
        .into_iter()
        .filter(|(op, _)| !op.starts_with("hold"))
        .collect();
    assert_eq!(warm, unheld);
    // One thread calls every op of a warm pass at TP 1 (weights held in parallel, as in the
    // first pass, could add up past the wall time): their time lies within the pass's.
    let warm_producer = &warm_trace.manifest().producer;
    let in_ops: f64 = warm
        .keys()
        .map(|op| warm_producer["op_seconds"][op]["seconds"].as_f64().unwrap())
        .sum();
    assert!(
        in_ops > 0.0 && in_ops <= warm_seconds,
        "{in_ops} s in ops of a {warm_seconds} s pass"
    );
}
