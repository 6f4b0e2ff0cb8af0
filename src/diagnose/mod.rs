//! The drill-down at a first divergence: with the candidate's model and settings at hand, check
//! what the traces cannot show — the weights that stage reads (the candidate's dequantization
//! and layout against the reference's) and each rank's shard of them (against vLLM's plan) —
//! and name the faulty step with that evidence. An engine's own shard manifest is checked
//! against the plan in [`manifest`], and the settings an engine ran with (a GGUF's metadata,
//! a `config.json`) against the reference's in [`settings`].

mod choice;
pub mod indexer;
pub mod manifest;
pub mod router;
pub mod settings;
mod shards;
mod weights;

use anyhow::Result;

use crate::compare::Fault;
use crate::exec::source::WeightSource;
use crate::model::names::WeightId;

pub use shards::check_shards;
pub use weights::check_weights;

/// The candidate as bisect ran it: its weights (with any planted fault) and its TP degree.
pub struct CandidateRun<'a> {
    pub src: &'a WeightSource,
    pub tp: usize,
    /// Whether the candidate reads the same files as the reference (so that any difference in
    /// a weight is the candidate's, not quantization noise of a conversion).
    pub same_files: bool,
    /// Routed experts the candidate chose in the divergent layer (to check only those).
    pub experts: Vec<u64>,
}

/// What the weights `ids` (a divergent stage's, or a layer's) and each rank's shards of them
/// show, if anything is wrong with them.
pub fn drill_down(
    reference: &WeightSource,
    cand: &CandidateRun,
    ids: &[WeightId],
) -> Result<Option<Fault>> {
    if cand.tp > 1 {
        if let Some(f) = check_shards(reference, cand, ids)? {
            return Ok(Some(f));
        }
    }
    check_weights(reference, cand, ids)
}
