//! Where a forward spends its time, op by op: [`Timed`] wraps any backend and adds each call's
//! wall time to an [`OpClock`], and [`TimedRecorder`] does the same for the stages handed to
//! the trace. A clock reading per call costs tens of nanoseconds against ops of microseconds
//! at least, so every recorded run keeps one (`producer.op_seconds`, `run --profile`).
//!
//! Calls made from several threads at once (tensor-parallel ranks as threads, experts in
//! parallel on the CPU) each add their own time: an op's seconds are thread-seconds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use serde_json::{json, Map, Value};

use super::attention_core::AttentionInputs;
use super::backend::{Backend, MlpInput};
use super::claim::Claim;
use super::forward::Recorder;
use super::indexer_core::IndexerInputs;
use super::mat::Mat;
use super::rope::{Rope, RotateSpec};
use super::stored::StoredBlock;
use crate::dtype::Precision;
use crate::model::kv_b::KvBDims;
use crate::trace::{OwnedStage, Stage};

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
    Attention,
    IndexerScores,
    Mlp,
    Mlps,
    AllReduce,
    Gather,
    /// A stage handed to the trace writer (copies, the statistics' tasks).
    Record,
    /// The forward's own host work between the ops: each token's expert choice,
    Route,
    /// the routed experts' input rows gathered,
    ExpertInputs,
    /// the experts' outputs added into each token's row by their routing weights,
    ExpertSum,
    /// the KV cache grown by the new positions,
    KvCache,
    /// the DSA indexer's top-k over its scores,
    IndexerTopk,
    /// and each query's key positions listed for the attention op.
    AttentionKeys,
}

impl Op {
    const ALL: [Op; 24] = [
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
        Op::Attention,
        Op::IndexerScores,
        Op::Mlp,
        Op::Mlps,
        Op::AllReduce,
        Op::Gather,
        Op::Record,
        Op::Route,
        Op::ExpertInputs,
        Op::ExpertSum,
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
            Op::Attention => "attention",
            Op::IndexerScores => "indexer_scores",
            Op::Mlp => "mlp",
            Op::Mlps => "mlps",
            Op::AllReduce => "all_reduce",
            Op::Gather => "gather",
            Op::Record => "record",
            Op::Route => "host: route",
            Op::ExpertInputs => "host: expert inputs",
            Op::ExpertSum => "host: expert sum",
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

/// Calls and nanoseconds per [`Op`], shared by every clone of a [`Timed`] backend.
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

/// Backend `B` with every op timed on a shared [`OpClock`].
#[derive(Clone)]
pub struct Timed<B> {
    pub inner: B,
    pub clock: Arc<OpClock>,
}

impl<B: Backend> Timed<B> {
    pub fn new(inner: B, clock: Arc<OpClock>) -> Self {
        Timed { inner, clock }
    }
}

impl<B: Backend> Backend for Timed<B> {
    type E = B::E;
    type Weight = B::Weight;

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn precision(&self) -> Precision {
        self.inner.precision()
    }

    fn hold(&self, w: Mat<f32>) -> Result<B::Weight> {
        self.clock.time(Op::Hold, || self.inner.hold(w))
    }

    fn hold_stored(&self, w: &StoredBlock<'_>) -> Result<B::Weight> {
        self.clock
            .time(Op::HoldStored, || self.inner.hold_stored(w))
    }

    fn hold_kv_b(
        &self,
        k_b: &StoredBlock<'_>,
        v_b: &StoredBlock<'_>,
        d: KvBDims,
    ) -> Result<B::Weight> {
        self.clock
            .time(Op::HoldKvB, || self.inner.hold_kv_b(k_b, v_b, d))
    }

    fn hold_values(&self, v: Vec<f32>) -> Vec<B::E> {
        self.inner.hold_values(v)
    }

    fn hold_exact(&self, v: Vec<f32>) -> Vec<B::E> {
        self.inner.hold_exact(v)
    }

    fn linear(&self, x: &Mat<B::E>, w: &B::Weight) -> Result<Mat<B::E>> {
        self.clock.time(Op::Linear, || self.inner.linear(x, w))
    }

    fn linear_exact(&self, x: &Mat<B::E>, w: &B::Weight) -> Result<Mat<B::E>> {
        self.clock
            .time(Op::LinearExact, || self.inner.linear_exact(x, w))
    }

    fn rms_norm(&self, x: &Mat<B::E>, w: &[B::E], eps: f64) -> Result<Mat<B::E>> {
        self.clock
            .time(Op::RmsNorm, || self.inner.rms_norm(x, w, eps))
    }

    fn layer_norm(&self, x: &Mat<B::E>, w: &[B::E], b: &[B::E], eps: f64) -> Result<Mat<B::E>> {
        self.clock
            .time(Op::LayerNorm, || self.inner.layer_norm(x, w, b, eps))
    }

    fn silu_mul(&self, gate: &Mat<B::E>, up: &Mat<B::E>) -> Result<Mat<B::E>> {
        self.clock
            .time(Op::SiluMul, || self.inner.silu_mul(gate, up))
    }

    fn add(&self, a: &Mat<B::E>, b: &Mat<B::E>) -> Result<Mat<B::E>> {
        self.clock.time(Op::Add, || self.inner.add(a, b))
    }

    fn round(&self, xs: &mut [B::E]) -> Result<()> {
        self.clock.time(Op::Round, || self.inner.round(xs))
    }

    fn rope(&self, m: &Mat<B::E>, rope: &Rope<B::E>, spec: RotateSpec) -> Result<Mat<B::E>> {
        self.clock.time(Op::Rope, || self.inner.rope(m, rope, spec))
    }

    fn attention(&self, a: &AttentionInputs<'_, B::E>) -> Result<Vec<B::E>> {
        self.clock.time(Op::Attention, || self.inner.attention(a))
    }

    fn indexer_scores(&self, a: &IndexerInputs<'_, B::E>) -> Result<Vec<B::E>> {
        self.clock
            .time(Op::IndexerScores, || self.inner.indexer_scores(a))
    }

    fn mlp(
        &self,
        x: &Mat<B::E>,
        gate: &B::Weight,
        up: &B::Weight,
        down: &B::Weight,
    ) -> Result<Mat<B::E>> {
        self.clock
            .time(Op::Mlp, || self.inner.mlp(x, gate, up, down))
    }

    fn mlps(&self, jobs: &[MlpInput<'_, Self>]) -> Result<Vec<Mat<B::E>>> {
        self.clock.time(Op::Mlps, || self.inner.mlps(jobs))
    }

    fn experts_at_once(&self) -> usize {
        self.inner.experts_at_once()
    }

    fn on_rank(&self, rank: usize) -> Self {
        Timed {
            inner: self.inner.on_rank(rank),
            clock: self.clock.clone(),
        }
    }

    fn computes(&self, rank: usize) -> bool {
        self.inner.computes(rank)
    }

    fn collectives_across_processes(&self) -> bool {
        self.inner.collectives_across_processes()
    }

    fn claim_kept(&self, w: &B::Weight) -> Result<Option<Claim>> {
        self.inner.claim_kept(w)
    }

    fn gather(&self, parts: Vec<Option<Mat<B::E>>>) -> Result<Vec<Mat<B::E>>> {
        self.clock.time(Op::Gather, || self.inner.gather(parts))
    }

    fn all_reduce(&self, parts: &[Mat<B::E>]) -> Result<Mat<B::E>> {
        self.clock
            .time(Op::AllReduce, || self.inner.all_reduce(parts))
    }

    fn host<T>(&self, step: Op, f: impl FnOnce() -> T) -> T {
        self.clock.time(step, f)
    }
}

/// A recorder whose stages are timed as [`Op::Record`].
pub struct TimedRecorder<'a> {
    pub inner: &'a mut dyn Recorder,
    pub clock: &'a OpClock,
}

impl Recorder for TimedRecorder<'_> {
    fn record(
        &mut self,
        name: &str,
        shape: &[u64],
        dims: &str,
        rank: Option<u32>,
        values: Stage<'_>,
    ) -> Result<()> {
        let inner = &mut *self.inner;
        self.clock
            .time(Op::Record, || inner.record(name, shape, dims, rank, values))
    }

    fn record_owned(
        &mut self,
        name: &str,
        shape: &[u64],
        dims: &str,
        rank: Option<u32>,
        values: OwnedStage,
    ) -> Result<()> {
        let inner = &mut *self.inner;
        self.clock.time(Op::Record, || {
            inner.record_owned(name, shape, dims, rank, values)
        })
    }

    fn layer_seconds(&mut self, layer: &str, seconds: f64) {
        self.inner.layer_seconds(layer, seconds);
    }
}
