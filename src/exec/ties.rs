//! Near ties at a top-k boundary, resolved as the reference resolved them.
//!
//! Where the reference's k-th DSA or router score is within [`NEAR_TIE`] of the best unchosen
//! one (relative to the layer's largest gap), a run at a lower precision may choose the other
//! key or expert: not a bug, yet its effect grows through every later stage. A candidate run
//! given these tie-breaks takes the reference's choice at exactly those positions — so what
//! still diverges is not a tie — and the diagnosis says how many it took.

use std::collections::BTreeMap;

use anyhow::Result;

use crate::compare::classify::NEAR_TIE;
use crate::compare::diff::{layer_of, whole_values};
use crate::trace::Trace;

/// Per layer, per prompt position: the reference's choice where it was a near tie.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TieBreaks {
    pub dsa: BTreeMap<u64, Vec<Option<Vec<i32>>>>,
    pub moe: BTreeMap<u64, Vec<Option<Vec<i32>>>>,
}

impl TieBreaks {
    /// The near ties of a reference trace that holds its top-k ids and gaps in full.
    pub fn from_trace(reference: &Trace) -> Result<TieBreaks> {
        let mut ties = TieBreaks::default();
        for s in reference.stages() {
            let (map, gap_stage) = if s.name.ends_with(".attn.index_topk") {
                (&mut ties.dsa, s.name.replace("index_topk", "index_gap"))
            } else if s.name.ends_with(".moe.topk_ids") {
                (&mut ties.moe, s.name.replace("topk_ids", "topk_gap"))
            } else {
                continue;
            };
            let (Some(layer), Some((ids, shape)), Some((gaps, _))) = (
                layer_of(&s.name),
                whole_values(reference, &s.name)?,
                whole_values(reference, &gap_stage)?,
            ) else {
                continue;
            };
            let k = shape.last().copied().unwrap_or(1).max(1) as usize;
            let largest = gaps.iter().copied().fold(0f32, f32::max);
            let near: Vec<Option<Vec<i32>>> = gaps
                .iter()
                .zip(ids.chunks(k))
                .map(|(&gap, row)| {
                    (gap >= 0.0 && f64::from(gap) <= NEAR_TIE * f64::from(largest))
                        .then(|| row.iter().map(|&v| v as i32).collect())
                })
                .collect();
            if near.iter().any(Option::is_some) {
                map.insert(layer, near);
            }
        }
        Ok(ties)
    }

    /// How many positions take the reference's choice.
    pub fn count(&self) -> usize {
        self.dsa
            .values()
            .chain(self.moe.values())
            .flatten()
            .filter(|c| c.is_some())
            .count()
    }

    /// The reference's choice at `position` of layer `l`, if that was a near tie.
    pub fn dsa_at(&self, l: u64, position: usize) -> Option<&[i32]> {
        self.dsa.get(&l)?.get(position)?.as_deref()
    }

    pub fn moe_at(&self, l: u64, position: usize) -> Option<&[i32]> {
        self.moe.get(&l)?.get(position)?.as_deref()
    }
}
