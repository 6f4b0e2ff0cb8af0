//! The CPU reference executor: GLM-5's forward, stage by stage, recorded into a trace.

pub mod attention;
pub mod attention_core;
pub mod backend;
pub mod claim;
pub mod few_tokens;
pub mod forward;
pub mod gemm_kernel;
pub mod hooks;
pub mod host_linear;
pub mod host_weight;
pub mod indexer_core;
pub mod inject;
pub mod kept;
pub mod lane_dot;
pub mod lazy_weight;
pub mod mat;
pub mod op_clock;
pub mod ops;
pub mod passes;
pub mod real;
pub mod rendezvous;
pub mod rope;
pub mod selftest;
pub mod sharder;
pub mod source;
pub mod stored;
pub mod ties;
pub mod timed;
pub mod tokenize;
pub mod tp;

use anyhow::Result;

use crate::trace::stats::StatsLater;
use crate::trace::{OwnedStage, Stage, StageLater, TraceWriter};

impl forward::Recorder for TraceWriter {
    fn record(&mut self, k: forward::StageKey<'_>, values: Stage<'_>) -> Result<()> {
        Ok(TraceWriter::record(
            self, k.name, k.shape, k.dims, k.rank, values,
        )?)
    }

    fn record_owned(&mut self, k: forward::StageKey<'_>, values: OwnedStage) -> Result<()> {
        Ok(TraceWriter::record_owned(
            self, k.name, k.shape, k.dims, k.rank, values,
        )?)
    }

    fn takes_stats(&self, name: &str) -> bool {
        TraceWriter::takes_stats(self, name)
    }

    fn record_stats(
        &mut self,
        k: forward::StageKey<'_>,
        len: usize,
        stats: StatsLater,
    ) -> Result<()> {
        Ok(TraceWriter::record_stats(
            self, k.name, k.shape, k.dims, k.rank, len, stats,
        )?)
    }

    fn record_later(
        &mut self,
        k: forward::StageKey<'_>,
        len: usize,
        values: StageLater,
    ) -> Result<()> {
        Ok(TraceWriter::record_later(
            self, k.name, k.shape, k.dims, k.rank, len, values,
        )?)
    }

    fn layer_seconds(&mut self, layer: &str, seconds: f64) {
        self.add_layer_seconds(layer, seconds);
    }
}
