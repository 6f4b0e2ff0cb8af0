//! A backend and a recorder with every call timed on an [`OpClock`]: what `run --profile` and
//! the trace's `producer.op_seconds` report.

use std::sync::Arc;

use anyhow::Result;

use crate::dtype::Precision;
use crate::exec::backend::{Backend, HeadCut, MlpJob, WeightedRows};
use crate::exec::forward::recorder::{Recorder, StageKey};
use crate::exec::mat::Mat;
use crate::exec::ops::attention_core::AttentionInputs;
use crate::exec::ops::indexer_core::IndexerInputs;
use crate::exec::ops::op_clock::{Op, OpClock};
use crate::exec::ops::rope::{Rope, RotateSpec};
use crate::exec::storage::claim::Claim;
use crate::exec::storage::stored::StoredBlock;
use crate::model::kv_b::KvBDims;
use crate::trace::stats::StatsLater;
use crate::trace::{OwnedStage, Stage, StageLater};

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

    fn placed(&self, m: Mat<B::E>) -> Result<Mat<B::E>> {
        self.inner.placed(m)
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

    fn rounded(&self, m: Mat<B::E>) -> Result<Mat<B::E>> {
        self.clock.time(Op::Round, || self.inner.rounded(m))
    }

    fn add_weighted(
        &self,
        sum: Option<Mat<B::E>>,
        shape: (usize, usize),
        outputs: &[WeightedRows<'_, B::E>],
    ) -> Result<Mat<B::E>> {
        self.clock.time(Op::ExpertSum, || {
            self.inner.add_weighted(sum, shape, outputs)
        })
    }

    fn rope(&self, m: &Mat<B::E>, rope: &Rope<B::E>, spec: RotateSpec) -> Result<Mat<B::E>> {
        self.clock.time(Op::Rope, || self.inner.rope(m, rope, spec))
    }

    fn head_columns(&self, m: &Mat<B::E>, cut: HeadCut) -> Result<Mat<B::E>> {
        self.clock
            .time(Op::HeadColumns, || self.inner.head_columns(m, cut))
    }

    fn attention(&self, a: &AttentionInputs<'_, B::E>) -> Result<Mat<B::E>> {
        self.clock.time(Op::Attention, || self.inner.attention(a))
    }

    fn indexer_scores(&self, a: &IndexerInputs<'_, B::E>) -> Result<Mat<B::E>> {
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

    fn mlps(&self, x: &Mat<B::E>, jobs: &[MlpJob<'_, B::Weight>]) -> Result<Vec<Mat<B::E>>> {
        self.clock.time(Op::Mlps, || self.inner.mlps(x, jobs))
    }

    fn experts_at_once(&self) -> usize {
        self.inner.experts_at_once()
    }

    fn fuses_mlp(&self) -> bool {
        self.inner.fuses_mlp()
    }

    fn kept_experts_join_any_group(&self) -> bool {
        self.inner.kept_experts_join_any_group()
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

    fn reads_ahead(&self) -> bool {
        self.inner.reads_ahead()
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
    fn record(&mut self, key: StageKey<'_>, values: Stage<'_>) -> Result<()> {
        let inner = &mut *self.inner;
        self.clock.time(Op::Record, || inner.record(key, values))
    }

    fn record_owned(&mut self, key: StageKey<'_>, values: OwnedStage) -> Result<()> {
        let inner = &mut *self.inner;
        self.clock
            .time(Op::Record, || inner.record_owned(key, values))
    }

    fn takes_stats(&self, name: &str) -> bool {
        self.inner.takes_stats(name)
    }

    fn record_stats(&mut self, key: StageKey<'_>, len: usize, stats: StatsLater) -> Result<()> {
        let inner = &mut *self.inner;
        self.clock
            .time(Op::Record, || inner.record_stats(key, len, stats))
    }

    fn record_later(&mut self, key: StageKey<'_>, len: usize, values: StageLater) -> Result<()> {
        let inner = &mut *self.inner;
        self.clock
            .time(Op::Record, || inner.record_later(key, len, values))
    }

    fn discards(&self) -> bool {
        self.inner.discards()
    }

    fn layer_seconds(&mut self, layer: &str, seconds: f64) {
        self.inner.layer_seconds(layer, seconds);
    }
}
