//! vLLM's tensor-parallel plan for GLM-5, per weight and rank: which
//! weights every rank holds whole, which are split and along which axis, and the index ranges
//! each rank holds. The TP executor takes its rank-local weight views from here, and engine
//! shards are checked against it.

use std::borrow::Cow;
use std::ops::Range;

use anyhow::{bail, Result};

use crate::model::names::{
    LayerWeight::{self, *},
    WeightId,
};
use crate::model::Glm5Config;

/// How a weight is laid out across the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    Replicated,
    /// Split evenly along `axis` (row-major axis of the stored tensor); a tensor of `parts`
    /// merged matrices along that axis (fused gate/up) has each part split.
    Split {
        axis: usize,
        parts: u64,
    },
    /// Expert parallelism: whole experts per rank (axis 0 of a stacked expert tensor; a
    /// per-expert tensor on the rank [`expert_rank`] names).
    Experts,
}

impl Placement {
    /// vLLM's class for the weight, in words.
    pub fn describe(self) -> &'static str {
        match self {
            Placement::Replicated => "replicated",
            Placement::Split { axis: 0, .. } => "split rows (ColumnParallel / vocab-parallel)",
            Placement::Split { parts: 2, .. } => "split gate and up halves (MergedColumnParallel)",
            Placement::Split { .. } => "split columns (RowParallel)",
            Placement::Experts => "whole experts per rank (EP)",
        }
    }
}

/// Where `id` goes at TP (with `ep`, routed experts whole per rank instead of split along their
/// intermediate dimension).
pub fn placement(id: &WeightId, ep: bool) -> Placement {
    let rows = Placement::Split { axis: 0, parts: 1 };
    match id {
        WeightId::Embed | WeightId::LmHead => rows,
        WeightId::FinalNorm => Placement::Replicated,
        // Under EP a per-expert tensor lives whole on the rank that owns the expert.
        WeightId::Expert { .. } if ep => Placement::Experts,
        WeightId::Expert { which, .. } => match which {
            ExpertsDown => Placement::Split { axis: 1, parts: 1 },
            _ => rows,
        },
        WeightId::Layer(_, w) => match w {
            // Whole heads: q_proj, q_b and kv_b rows are head-major; llama.cpp's split k_b / v_b carry
            // the head as their outer axis.
            QProj | QB | KvB | KB | VB | Gate | Up | SharedGate | SharedUp => rows,
            AttnOut | Down | SharedDown => Placement::Split { axis: 1, parts: 1 },
            ExpertsGate | ExpertsUp | ExpertsGateUp | ExpertsDown if ep => Placement::Experts,
            ExpertsGate | ExpertsUp => Placement::Split { axis: 1, parts: 1 },
            ExpertsGateUp => Placement::Split { axis: 1, parts: 2 },
            ExpertsDown => Placement::Split { axis: 2, parts: 1 },
            _ => Placement::Replicated,
        },
    }
}

/// Whether vLLM splits a matrix of `role` (one expert's, for routed experts) by output rows
/// (ColumnParallel) rather than by input columns (RowParallel).
pub fn splits_rows(role: LayerWeight) -> bool {
    let id = match role {
        ExpertsGate | ExpertsUp | ExpertsDown => WeightId::Expert {
            layer: 0,
            expert: 0,
            which: role,
        },
        _ => WeightId::Layer(0, role),
    };
    placement(&id, false) == Placement::Split { axis: 0, parts: 1 }
}

/// What one rank holds of a tensor: pieces along one axis (everything when `axis` is None).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankView {
    pub axis: Option<usize>,
    pub pieces: Vec<Range<u64>>,
}

impl RankView {
    /// Elements this rank holds of a tensor of `shape`.
    pub fn elements(&self, shape: &[u64]) -> u64 {
        let total: u64 = shape.iter().product();
        match self.axis {
            None => total,
            Some(axis) => {
                let along: u64 = self.pieces.iter().map(|p| p.end - p.start).sum();
                total / shape[axis].max(1) * along
            }
        }
    }

    /// `rows 0..3584`, `cols 2048..4096`, `heads 0..8`, `experts 0..32`, `all` for a tensor
    /// of `dims` dimensions.
    pub fn describe(&self, placement: Placement, dims: usize) -> String {
        let Some(axis) = self.axis else {
            return "all".into();
        };
        let what = match (placement, axis) {
            (Placement::Experts, _) => "experts",
            (_, 0) if dims == 3 => "heads",
            (_, 0) => "rows",
            (_, 1) if dims == 3 => "intermediate",
            (_, 1) => "cols",
            _ => "axis 2",
        };
        let pieces: Vec<String> = self
            .pieces
            .iter()
            .map(|p| format!("{}..{}", p.start, p.end))
            .collect();
        format!("{what} {}", pieces.join(" + "))
    }
}

/// The part of a tensor of `shape` that rank `rank` of `tp` holds under `placement`; an error
/// when the split axis does not divide evenly (vLLM asserts the same).
pub fn rank_view(placement: Placement, shape: &[u64], rank: u64, tp: u64) -> Result<RankView> {
    if rank >= tp {
        bail!("rank {rank} of {tp}");
    }
    let (axis, parts) = match placement {
        Placement::Replicated => {
            return Ok(RankView {
                axis: None,
                pieces: vec![],
            })
        }
        Placement::Split { axis, parts } => (axis, parts),
        Placement::Experts => (0, 1),
    };
    let Some(&len) = shape.get(axis) else {
        bail!("shape {shape:?} has no axis {axis} to split");
    };
    if len % (parts * tp) != 0 {
        bail!("axis {axis} of shape {shape:?} does not split into {tp} ranks × {parts} parts");
    }
    let (part, share) = (len / parts, len / parts / tp);
    Ok(RankView {
        axis: Some(axis),
        pieces: (0..parts)
            .map(|p| p * part + rank * share..p * part + (rank + 1) * share)
            .collect(),
    })
}

/// Whether TP `tp` splits every split dimension of `cfg` evenly (vLLM asserts the heads; the
/// widths follow at GLM-5's sizes); the error names the dimension.
pub fn check_degree(cfg: &Glm5Config, tp: u64) -> Result<()> {
    let dims = [
        ("num_attention_heads", cfg.num_attention_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("moe_intermediate_size", cfg.moe_intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ];
    for (name, v) in dims {
        if tp == 0 || v % tp != 0 {
            bail!("--tp {tp}: {name} = {v} does not split evenly over {tp} ranks");
        }
    }
    Ok(())
}

/// The rank holding routed expert `e` of `experts` under expert parallelism.
pub fn expert_rank(e: u64, experts: u64, tp: u64) -> u64 {
    e / (experts / tp).max(1)
}

/// Elements of a tensor of `shape`; `None` past 64 bits.
pub fn elements(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
}

/// The shape of `view` taken out of a tensor of `shape`.
pub fn view_shape(shape: &[u64], view: &RankView) -> Vec<u64> {
    let mut s = shape.to_vec();
    if let Some(a) = view.axis {
        s[a] = view.pieces.iter().map(|p| p.end - p.start).sum();
    }
    s
}

/// The values a rank holds under `view` of a row-major tensor of `shape`, in row-major order of
/// [`view_shape`]: its pieces side by side along the split axis.
pub fn gather<'v>(values: &'v [f32], shape: &[u64], view: &RankView) -> Cow<'v, [f32]> {
    let Some(axis) = view.axis else {
        return Cow::Borrowed(values);
    };
    let len = shape[axis] as usize;
    let inner = shape[axis + 1..].iter().product::<u64>() as usize;
    let mut out = Vec::with_capacity(view.elements(shape) as usize);
    for outer in values.chunks_exact(len * inner) {
        for p in &view.pieces {
            out.extend_from_slice(&outer[p.start as usize * inner..p.end as usize * inner]);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_parallel_matrices_split_rows_row_parallel_ones_columns() {
        for role in [
            QB,
            KvB,
            Gate,
            Up,
            SharedGate,
            SharedUp,
            ExpertsGate,
            ExpertsUp,
        ] {
            assert!(splits_rows(role), "{role:?}");
        }
        for role in [AttnOut, Down, SharedDown, ExpertsDown] {
            assert!(!splits_rows(role), "{role:?}");
        }
    }

    #[test]
    fn heads_rows_and_merged_halves_split_as_vllm_does() {
        let kv_b = placement(&WeightId::Layer(0, KvB), false);
        let v = rank_view(kv_b, &[28672, 512], 3, 8).unwrap();
        assert_eq!(v.pieces, vec![10752..14336]);
        assert_eq!(v.describe(kv_b, 2), "rows 10752..14336");
        let o = placement(&WeightId::Layer(0, AttnOut), false);
        assert_eq!(
            rank_view(o, &[6144, 16384], 1, 4).unwrap().pieces,
            vec![4096..8192]
        );
        let gate_up = placement(&WeightId::Layer(3, ExpertsGateUp), false);
        let v = rank_view(gate_up, &[256, 4096, 6144], 1, 2).unwrap();
        assert_eq!(v.pieces, vec![1024..2048, 3072..4096]);
        assert_eq!(v.elements(&[256, 4096, 6144]), 256 * 2048 * 6144);
        let ep = placement(&WeightId::Layer(3, ExpertsDown), true);
        assert_eq!(
            rank_view(ep, &[256, 6144, 2048], 7, 8).unwrap().pieces,
            vec![224..256]
        );
        assert_eq!(
            placement(&WeightId::Layer(0, QA), false),
            Placement::Replicated
        );
        assert!(
            rank_view(kv_b, &[28672, 512], 0, 3).is_err(),
            "64 heads over 3 ranks"
        );
    }
}
