//! Where a forward spends its time, op by op: an [`OpClock`] adds up each [`Op`]'s calls and
//! wall time ([`crate::exec::forward::timed`] wraps a backend and a recorder around one). A clock reading per
//! call costs tens of nanoseconds against ops of microseconds at least, so every recorded run
//! keeps one (`producer.op_seconds`, `run --profile`).
//!
//! Calls made from several threads at once (tensor-parallel ranks as threads, experts in
//! parallel on the CPU) each add their own time: an op's seconds are thread-seconds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde_json::{json, Map, Value};

/// What the clock times: the backend's ops and the recording of stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A weight made ready (dequantized, rounded, uploaded where the backend computes).
    Hold,
    HoldStored,
    HoldKvB,
    Linear,
    LinearExact,
    RmsNorm,
    LayerNorm,
    SiluMul,
    Add,
    Round,
    Rope,
    HeadColumns,
    Attention,
    IndexerScores,
    Mlp,
    Mlps,
    /// Routed experts' outputs added into each token's row by their routing weights.
    ExpertSum,
    AllReduce,
    Gather,
    /// A stage handed to the trace writer (copies, the statistics' tasks).
    Record,
    /// The forward's own host work between the ops: each token's expert choice,
    Route,
    /// the routed experts' input rows gathered,
    ExpertInputs,
    /// the KV cache grown by the new positions,
    KvCache,
    /// the DSA indexer's top-k over its scores,
    IndexerTopk,
    /// and each query's key positions listed for the attention op.
    AttentionKeys,
}

impl Op {
    const ALL: [Op; 25] = [
        Op::Hold,
        Op::HoldStored,
        Op::HoldKvB,
        Op::Linear,
        Op::LinearExact,
        Op::RmsNorm,
        Op::LayerNorm,
        Op::SiluMul,
        Op::Add,
        Op::Round,
        Op::Rope,
        Op::HeadColumns,
        Op::Attention,
        Op::IndexerScores,
        Op::Mlp,
        Op::Mlps,
        Op::ExpertSum,
        Op::AllReduce,
        Op::Gather,
        Op::Record,
        Op::Route,
        Op::ExpertInputs,
        Op::KvCache,
        Op::IndexerTopk,
        Op::AttentionKeys,
    ];

    /// The name `producer.op_seconds` and the profile table use.
    pub fn name(self) -> &'static str {
        match self {
            Op::Hold => "hold",
            Op::HoldStored => "hold_stored",
            Op::HoldKvB => "hold_kv_b",
            Op::Linear => "linear",
            Op::LinearExact => "linear_exact",
            Op::RmsNorm => "rms_norm",
            Op::LayerNorm => "layer_norm",
            Op::SiluMul => "silu_mul",
            Op::Add => "add",
            Op::Round => "round",
            Op::Rope => "rope",
            Op::HeadColumns => "head_columns",
            Op::Attention => "attention",
            Op::IndexerScores => "indexer_scores",
            Op::Mlp => "mlp",
            Op::Mlps => "mlps",
            Op::AllReduce => "all_reduce",
            Op::Gather => "gather",
            Op::Record => "record",
            Op::Route => "host: route",
            Op::ExpertInputs => "host: expert inputs",
            Op::ExpertSum => "expert_sum",
            Op::KvCache => "host: kv cache",
            Op::IndexerTopk => "host: indexer top-k",
            Op::AttentionKeys => "host: attention keys",
        }
    }
}

#[derive(Default)]
struct Tally {
    calls: AtomicU64,
    nanos: AtomicU64,
}

/// Calls and nanoseconds per [`Op`], shared by every clone of a [`crate::exec::forward::timed::Timed`] backend.
#[derive(Default)]
pub struct OpClock {
    tallies: [Tally; Op::ALL.len()],
}

/// One op's share of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    pub op: Op,
    pub calls: u64,
    pub seconds: f64,
}

impl OpClock {
    /// `f`, its wall time added to `op`.
    pub fn time<T>(&self, op: Op, f: impl FnOnce() -> T) -> T {
        let began = Instant::now();
        let out = f();
        let tally = &self.tallies[op as usize];
        tally.calls.fetch_add(1, Ordering::Relaxed);
        tally
            .nanos
            .fetch_add(began.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Forget what was timed so far (the unrecorded warm-up passes).
    pub fn reset(&self) {
        for t in &self.tallies {
            t.calls.store(0, Ordering::Relaxed);
            t.nanos.store(0, Ordering::Relaxed);
        }
    }

    /// The ops called so far, the costliest first.
    pub fn times(&self) -> Vec<OpTime> {
        let mut times: Vec<OpTime> = Op::ALL
            .iter()
            .zip(&self.tallies)
            .map(|(&op, t)| OpTime {
                op,
                calls: t.calls.load(Ordering::Relaxed),
                seconds: t.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            })
            .filter(|t| t.calls > 0)
            .collect();
        times.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        times
    }

    /// `{op: {"calls": n, "seconds": s}}`, for the trace's producer.
    pub fn to_json(&self) -> Value {
        let map: Map<String, Value> = self
            .times()
            .into_iter()
            .map(|t| {
                (
                    t.op.name().to_string(),
                    json!({"calls": t.calls, "seconds": t.seconds}),
                )
            })
            .collect();
        Value::Object(map)
    }
}
