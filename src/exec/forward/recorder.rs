//! The seam between the forward and whatever keeps its stages: the [`Recorder`] trait, the
//! trace writer behind it, a recorder that keeps nothing ([`Discard`]) and one that rehearses a
//! run's recording ahead of time ([`Rehearsal`]).

use anyhow::Result;

use crate::exec::mat::{Mat, Queue};
use crate::exec::real::Real;
use crate::trace::stats::StatsLater;
use crate::trace::{OwnedStage, Stage, StageLater, TraceWriter};

/// A stage as the forward hands it over: its name, row-major shape and dims spec, and the
/// tensor-parallel rank whose part it is (None: the whole tensor).
#[derive(Clone, Copy, Debug)]
pub struct StageKey<'a> {
    pub name: &'a str,
    pub shape: &'a [u64],
    pub dims: &'a str,
    pub rank: Option<u32>,
}

impl<'a> StageKey<'a> {
    pub fn new(name: &'a str, shape: &'a [u64], dims: &'a str, rank: Option<u32>) -> Self {
        StageKey {
            name,
            shape,
            dims,
            rank,
        }
    }
}

/// Receives each stage as it is computed.
pub trait Recorder {
    fn record(&mut self, key: StageKey<'_>, values: Stage<'_>) -> Result<()>;

    /// [`Self::record`] with the values handed over: a stage the forward is done with need
    /// not be copied.
    fn record_owned(&mut self, key: StageKey<'_>, values: OwnedStage) -> Result<()> {
        self.record(key, values.view())
    }

    /// Whether stage `name` may be recorded by its statistics alone ([`Self::record_stats`]),
    /// computed where its values are: a trace that does not store it whole. Recorders that
    /// keep or compare values say no.
    fn takes_stats(&self, _name: &str) -> bool {
        false
    }

    /// Record an f32 stage of `len` values by its statistics alone, finished when the recorder
    /// needs them; only where [`Self::takes_stats`] said so.
    fn record_stats(&mut self, key: StageKey<'_>, _len: usize, _stats: StatsLater) -> Result<()> {
        anyhow::bail!("stage {} needs its values, not only statistics", key.name)
    }

    /// [`Self::record_owned`] of `len` values still on their way (a copy from a GPU queued
    /// beside the forward): a recorder that writes them waits for them on a thread of its
    /// own; this one waits now.
    fn record_later(&mut self, key: StageKey<'_>, _len: usize, values: StageLater) -> Result<()> {
        self.record_owned(key, values()?)
    }

    /// Whether every stage is dropped unseen (generation steps): the forward then neither
    /// fetches nor copies their values.
    fn discards(&self) -> bool {
        false
    }

    /// The wall time a layer (`L3`) or its MLP or MoE block (`L3.ffn`) took, recording
    /// included.
    fn layer_seconds(&mut self, _layer: &str, _seconds: f64) {}
}

/// Records nothing: generation steps after the traced prompt.
pub struct Discard;

impl Recorder for Discard {
    fn record(&mut self, _: StageKey<'_>, _: Stage<'_>) -> Result<()> {
        Ok(())
    }

    fn discards(&self) -> bool {
        true
    }
}

/// Records like another recorder and keeps nothing: the warm-up passes before a timed one. The
/// stages are taken as that recorder takes them (statistics on the device, or values copied
/// back) and dropped once they land, so that the page-locked buffers and device memory their
/// copies need are set aside before the timed pass, not inside it.
pub struct Rehearsal<'a> {
    like: &'a dyn Recorder,
    /// The statistics and copies still on their way, by layer, the current one last: as the
    /// trace writer, it waits for a layer's once it is [`LAYERS_AHEAD`] layers behind.
    pending: std::collections::VecDeque<Vec<Landing>>,
}

/// A stage's statistics or copy on its way: waits for it and drops it.
type Landing = Box<dyn FnOnce() -> Result<()> + Send>;

/// Layers a rehearsal's stages may be on their way for (the trace writer's groups ahead).
const LAYERS_AHEAD: usize = 4;

impl<'a> Rehearsal<'a> {
    pub fn like(like: &'a dyn Recorder) -> Self {
        Rehearsal {
            like,
            pending: [Vec::new()].into(),
        }
    }

    /// `landing` with the current layer's; the layers too far behind landed.
    fn add(&mut self, landing: Landing) -> Result<()> {
        if let Some(layer) = self.pending.back_mut() {
            layer.push(landing);
        }
        self.land(LAYERS_AHEAD)
    }

    /// Wait for the stages of the layers before the last `layers`, and drop them.
    fn land(&mut self, layers: usize) -> Result<()> {
        while self.pending.len() > layers {
            let oldest = self.pending.pop_front().unwrap_or_default();
            oldest.into_iter().try_for_each(|landing| landing())?;
        }
        Ok(())
    }

    /// Wait for every stage's statistics and copies, and drop them.
    pub fn finish(mut self) -> Result<()> {
        self.land(0)
    }
}

impl Recorder for Rehearsal<'_> {
    fn record(&mut self, _: StageKey<'_>, _: Stage<'_>) -> Result<()> {
        Ok(())
    }

    fn takes_stats(&self, name: &str) -> bool {
        self.like.takes_stats(name)
    }

    fn record_stats(&mut self, _: StageKey<'_>, _len: usize, stats: StatsLater) -> Result<()> {
        self.add(Box::new(move || stats().map(drop)))
    }

    fn record_later(&mut self, _: StageKey<'_>, _len: usize, values: StageLater) -> Result<()> {
        self.add(Box::new(move || values().map(drop)))
    }

    fn discards(&self) -> bool {
        self.like.discards()
    }

    /// A layer (not its FFN block alone) is done: its stages are a layer behind from now.
    fn layer_seconds(&mut self, layer: &str, _seconds: f64) {
        if !layer.contains('.') {
            self.pending.push_back(Vec::new());
        }
    }
}

/// A matrix's values for the trace writer, shared with it: no copy unless the forward changes
/// them later.
pub(super) fn shared<E: Real>(m: &Mat<E>) -> Result<OwnedStage> {
    Ok(E::shared_stage(m.shared_data()?))
}

/// Record matrix `m` whole: shared with the recorder where the host holds its values, else
/// from a copy queued beside the forward, which the recorder waits for (the forward does not).
pub(super) fn record_mat<E: Real>(
    rec: &mut dyn Recorder,
    key: StageKey<'_>,
    m: &Mat<E>,
) -> Result<()> {
    if rec.discards() {
        return Ok(());
    }
    if m.on_host() {
        return rec.record_owned(key, shared(m)?);
    }
    let later = m.values_later(Queue::Beside)?;
    rec.record_later(
        key,
        m.len(),
        Box::new(move || Ok(E::shared_stage(later()?))),
    )
}

impl Recorder for TraceWriter {
    fn record(&mut self, k: StageKey<'_>, values: Stage<'_>) -> Result<()> {
        Ok(TraceWriter::record(
            self, k.name, k.shape, k.dims, k.rank, values,
        )?)
    }

    fn record_owned(&mut self, k: StageKey<'_>, values: OwnedStage) -> Result<()> {
        Ok(TraceWriter::record_owned(
            self, k.name, k.shape, k.dims, k.rank, values,
        )?)
    }

    fn takes_stats(&self, name: &str) -> bool {
        TraceWriter::takes_stats(self, name)
    }

    fn record_stats(&mut self, k: StageKey<'_>, len: usize, stats: StatsLater) -> Result<()> {
        Ok(TraceWriter::record_stats(
            self, k.name, k.shape, k.dims, k.rank, len, stats,
        )?)
    }

    fn record_later(&mut self, k: StageKey<'_>, len: usize, values: StageLater) -> Result<()> {
        Ok(TraceWriter::record_later(
            self, k.name, k.shape, k.dims, k.rank, len, values,
        )?)
    }

    fn layer_seconds(&mut self, layer: &str, seconds: f64) {
        self.add_layer_seconds(layer, seconds);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::trace::stats::TensorStats;

    /// A recorder that takes every stage by its statistics (as a trace writer does for the
    /// stages it does not store whole).
    struct ByStats;

    impl Recorder for ByStats {
        fn record(&mut self, _: StageKey<'_>, _: Stage<'_>) -> Result<()> {
            Ok(())
        }

        fn takes_stats(&self, _: &str) -> bool {
            true
        }
    }

    #[test]
    fn a_rehearsal_waits_for_each_stage_a_few_layers_behind_and_for_all_at_the_end() {
        let like = ByStats;
        let mut rehearsal = Rehearsal::like(&like);
        assert!(rehearsal.takes_stats("L0.attn_norm"));
        assert!(!rehearsal.discards());
        let landed = Arc::new(AtomicUsize::new(0));
        let key = StageKey::new("L0.x", &[1], "d", None);
        let layers = LAYERS_AHEAD + 2;
        for layer in 0..layers {
            for _ in 0..3 {
                let landed = landed.clone();
                let stats: StatsLater = Box::new(move || {
                    landed.fetch_add(1, Ordering::Relaxed);
                    Ok(TensorStats::of::<f32>(&[1.0]))
                });
                rehearsal.record_stats(key, 1, stats).unwrap();
            }
            let values: StageLater = {
                let landed = landed.clone();
                Box::new(move || {
                    landed.fetch_add(1, Ordering::Relaxed);
                    Ok(OwnedStage::F32(Arc::new(vec![1.0])))
                })
            };
            rehearsal.record_later(key, 1, values).unwrap();
            rehearsal.layer_seconds(&format!("L{layer}.ffn"), 0.0);
            rehearsal.layer_seconds(&format!("L{layer}"), 0.0);
        }
        // Four stages a layer, the last `LAYERS_AHEAD` layers' still on their way.
        assert_eq!(landed.load(Ordering::Relaxed), 4 * (layers - LAYERS_AHEAD));
        rehearsal.finish().unwrap();
        assert_eq!(landed.load(Ordering::Relaxed), 4 * layers);
    }

    #[test]
    fn a_rehearsal_reports_a_stage_that_failed_to_land() {
        let like = ByStats;
        let mut rehearsal = Rehearsal::like(&like);
        let key = StageKey::new("L0.x", &[1], "d", None);
        let failed: StatsLater = Box::new(|| anyhow::bail!("the device was lost"));
        rehearsal.record_stats(key, 1, failed).unwrap();
        let err = rehearsal.finish().unwrap_err();
        assert!(format!("{err:#}").contains("the device was lost"));
    }
}
