//! vLLM's tensor-parallel plan for GLM-5: per weight and rank ([`plan`]), and the bytes a rank
//! holds.

pub mod bytes;
pub mod identify;
pub mod manifest;
pub mod plan;

use crate::model::names::WeightId;
use plan::{placement, Placement};

/// Whether vLLM splits this weight across TP ranks (ColumnParallel, RowParallel, vocab-parallel,
/// or experts split along their intermediate dimension) rather than replicating it.
pub fn is_tp_sharded(id: &WeightId) -> bool {
    placement(id, false) != Placement::Replicated
}

/// Bytes one rank holds at TP `tp`: replicated tensors whole, sharded ones divided evenly.
/// `tensors` pairs each stored tensor's recognised role (if any) with its bytes; unrecognised
/// tensors count as replicated.
pub fn bytes_per_rank(tensors: &[(Option<WeightId>, u64)], tp: u64) -> u64 {
    tensors
        .iter()
        .map(|(id, bytes)| match id {
            Some(id) if is_tp_sharded(id) => bytes.div_ceil(tp),
            _ => *bytes,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::names::LayerWeight::*;

    #[test]
    fn attention_up_projections_shard_and_norms_replicate() {
        let t = [
            (Some(WeightId::Layer(0, QB)), 800),
            (Some(WeightId::Layer(0, QA)), 100),
            (None, 10),
        ];
        assert_eq!(bytes_per_rank(&t, 1), 910);
        assert_eq!(bytes_per_rank(&t, 4), 200 + 100 + 10);
    }
}
