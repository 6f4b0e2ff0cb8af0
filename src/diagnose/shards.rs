//! Each rank's shard of the divergent stage's split weights, identified against vLLM's plan.

use anyhow::Result;

use super::CandidateRun;
use crate::compare::Fault;
use crate::exec::source::sharder::Sharder;
use crate::exec::source::WeightSource;
use crate::model::names::{LayerWeight::*, WeightId};
use crate::shard::identify::{Dtype, ObservedShard, Reference};
use crate::shard::plan::{placement, Placement};

/// The first split weight among `ids` whose ranks hold other slices than the plan gives.
pub fn check_shards(
    reference: &WeightSource,
    cand: &CandidateRun,
    ids: &[WeightId],
) -> Result<Option<Fault>> {
    let tp = cand.tp;
    let sharder = Sharder {
        tp,
        ep: false,
        fault: cand.src.fault(),
    };
    for &id in ids {
        let WeightId::Layer(_, role) = id else {
            continue;
        };
        let plan = placement(&id, false);
        let stacked_experts = matches!(role, ExpertsGate | ExpertsUp | ExpertsDown);
        if !matches!(plan, Placement::Split { .. }) || stacked_experts {
            continue;
        }
        let w = reference.matrix(id)?;
        // A candidate whose weight itself differs is the weight check's case.
        if cand.src.matrix(id)? != w {
            continue;
        }
        let label = id.to_string();
        let shape = [w.rows as u64, w.cols as u64];
        let whole = Reference::new(&label, w.data(), &shape, plan, tp as u64)?;
        let mut verdicts = (0..tp)
            .map(|rank| {
                let view = sharder.shard(&w, role, rank)?;
                let view_shape = [view.rows as u64, view.cols as u64];
                let seen = ObservedShard::values(&view_shape, Dtype::F32, view.data());
                whole.identify(rank as u64, &seen)
            })
            .collect::<Result<Vec<_>>>()?;
        whole.same_block_everywhere(&mut verdicts);
        let wrong: Vec<_> = verdicts.iter().filter(|v| v.class.is_some()).collect();
        let Some(class) = wrong.first().and_then(|v| v.class) else {
            continue;
        };
        return Ok(Some(Fault {
            class,
            summary: format!(
                "{label}: {} of {tp} ranks hold another slice than the plan gives",
                wrong.len()
            ),
            evidence: wrong.iter().map(|v| v.evidence.clone()).collect(),
            weight: Some(label),
        }));
    }
    Ok(None)
}
