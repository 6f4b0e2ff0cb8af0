//! Which slice of the full weight a rank's shard is — the plan's block for that rank, another
//! rank's block, the whole tensor, a block along an axis the plan does not split, or one
//! contiguous block of a tensor the plan splits part by part — and the docs/design.md §7 class that
//! follows (`unsharded_weight`, `wrong_shard_layout`).
//!
//! A shard is recognised from its values, else its hash, else its statistics, each within one
//! rounding to the type the rank holds it in. `glmcheck shards --actual` feeds it an engine's
//! manifest; a drill-down that has a rank's weight view in hand passes the values themselves:
//!
//! ```no_run
//! # use glmcheck::shard::{identify::*, plan::*};
//! # use glmcheck::model::names::{WeightId, LayerWeight};
//! # fn f(full: &[f32], shape: &[u64], view: &[f32], view_shape: &[u64]) -> anyhow::Result<()> {
//! let p = placement(&WeightId::Layer(0, LayerWeight::KvB), false);
//! let reference = Reference::new("L0.attn.kv_b", full, shape, p, 4)?;
//! let shard = ObservedShard::values(view_shape, Dtype::F32, view);
//! let verdict = reference.identify(3, &shard)?;
//! println!("{:?}: {}", verdict.class, verdict.evidence);
//! # Ok(()) }
//! ```

mod observed;

use std::borrow::Cow;
use std::cell::OnceCell;

use anyhow::{bail, Result};

pub use observed::{Dtype, ObservedShard, ShardStats};

use super::plan::{elements, gather, rank_view, view_shape, Placement, RankView};
use crate::compare::fault::FaultClass;

/// Which kind of slice of the full weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SliceKind {
    /// The whole tensor.
    Whole,
    /// The plan's block for rank `.0`.
    Planned(u64),
    /// Rank `.0`'s block along an axis the plan does not split (every axis of a replicated
    /// weight).
    OtherAxis(u64),
    /// Rank `.0`'s one contiguous block of a merged tensor (gate/up) that the plan splits part
    /// by part.
    Contiguous(u64),
}

/// A slice of the full weight: its kind and the index ranges it takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice {
    pub kind: SliceKind,
    pub view: RankView,
}

/// How a shard was recognised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Basis {
    /// Every value within one rounding of the slice's.
    Values,
    /// Equal hash in the shard's type.
    Hash,
    /// Nearest statistics, at `distance` roundings (see [`ShardStats::distance`]); over 1 means
    /// nothing matched.
    Stats { distance: f64 },
    /// No slice of the weight has the shard's number of elements.
    Size,
}

/// What one rank holds of a weight against the plan.
#[derive(Clone, Debug)]
pub struct ShardVerdict {
    pub rank: u64,
    /// The plan's slice for this rank; `None` when the plan gives it nothing (an expert another
    /// rank owns under EP).
    pub expected: Option<Slice>,
    /// What the shard was recognised as; `None` when it matches no slice.
    pub found: Option<Slice>,
    pub basis: Basis,
    /// `None` when the shard is what the plan gives; [`FaultClass::Unknown`] when unidentified.
    pub class: Option<FaultClass>,
    /// One sentence: what the rank holds and what the plan gives.
    pub evidence: String,
}

/// The full reference weight and how the plan lays it across `tp` ranks: what every rank's
/// shard of it is identified against.
pub struct Reference<'a> {
    label: &'a str,
    values: &'a [f32],
    shape: &'a [u64],
    placement: Placement,
    tp: u64,
    /// A per-expert tensor under EP: the rank that holds it whole.
    owner: Option<u64>,
    /// Every slice a shard may be, the plan's blocks first in rank order.
    candidates: Vec<Slice>,
    /// Statistics of each candidate, computed once when a shard is judged by statistics.
    stats: OnceCell<Vec<ShardStats>>,
}

impl<'a> Reference<'a> {
    /// `values` (row-major, of `shape`) split across `tp` ranks under `placement`; `label`
    /// names it in evidence. An error when the shape does not hold the values or the plan's
    /// axis does not split evenly.
    pub fn new(
        label: &'a str,
        values: &'a [f32],
        shape: &'a [u64],
        placement: Placement,
        tp: u64,
    ) -> Result<Self> {
        Self::make(label, values, shape, placement, tp, None)
    }

    /// A tensor held whole by rank `owner` and by no other (one expert's matrix under EP).
    pub fn owned(
        label: &'a str,
        values: &'a [f32],
        shape: &'a [u64],
        owner: u64,
        tp: u64,
    ) -> Result<Self> {
        if owner >= tp {
            bail!("{label}: owner rank {owner} of {tp}");
        }
        Self::make(label, values, shape, Placement::Replicated, tp, Some(owner))
    }

    fn make(
        label: &'a str,
        values: &'a [f32],
        shape: &'a [u64],
        placement: Placement,
        tp: u64,
        owner: Option<u64>,
    ) -> Result<Self> {
        if tp == 0 || elements(shape) != Some(values.len() as u64) {
            bail!(
                "{label}: {} values for shape {shape:?} at TP {tp}",
                values.len()
            );
        }
        // An owned tensor has no planned blocks: its owner's slice is the whole.
        let ranks = if owner.is_some() { 0..0 } else { 0..tp };
        let mut candidates: Vec<Slice> = ranks
            .map(|r| {
                let view = rank_view(placement, shape, r, tp)?;
                Ok(Slice {
                    kind: SliceKind::Planned(r),
                    view,
                })
            })
            .collect::<Result<_>>()
            .map_err(|e: anyhow::Error| anyhow::anyhow!("{label}: {e}"))?;
        candidates.push(Slice {
            kind: SliceKind::Whole,
            view: whole(),
        });
        let split = match placement {
            Placement::Split { axis, parts } => Some((axis, parts)),
            Placement::Experts if owner.is_none() => Some((0, 1)),
            _ => None,
        };
        let mut blocks = |kind: fn(u64) -> SliceKind, axis: usize| {
            for r in 0..tp {
                let p = Placement::Split { axis, parts: 1 };
                if let Ok(view) = rank_view(p, shape, r, tp) {
                    candidates.push(Slice {
                        kind: kind(r),
                        view,
                    });
                }
            }
        };
        if tp > 1 {
            for axis in (0..shape.len()).filter(|&a| Some(a) != split.map(|s| s.0)) {
                blocks(SliceKind::OtherAxis, axis);
            }
            if let Some((axis, _)) = split.filter(|s| s.1 > 1) {
                blocks(SliceKind::Contiguous, axis);
            }
        }
        Ok(Reference {
            label,
            values,
            shape,
            placement,
            tp,
            owner,
            candidates,
            stats: OnceCell::new(),
        })
    }

    /// The plan's slice for `rank`; `None` when the plan gives it nothing.
    pub fn planned(&self, rank: u64) -> Option<Slice> {
        match self.owner {
            Some(o) if o == rank => Some(Slice {
                kind: SliceKind::Whole,
                view: whole(),
            }),
            Some(_) => None,
            None => self
                .candidates
                .iter()
                .find(|c| c.kind == SliceKind::Planned(rank))
                .cloned(),
        }
    }

    /// The values of `slice` in row-major order.
    pub fn values_of(&self, slice: &Slice) -> Cow<'a, [f32]> {
        gather(self.values, self.shape, &slice.view)
    }

    /// The shape `slice` has when taken out of the weight.
    pub fn shape_of(&self, slice: &Slice) -> Vec<u64> {
        view_shape(self.shape, &slice.view)
    }

    /// `rows 0..48`, `cols 64..128`, `heads 0..2`, `experts 0..4`, `all`.
    pub fn describe(&self, slice: &Slice) -> String {
        let placement = match slice.kind {
            SliceKind::Planned(_) => self.placement,
            _ => Placement::Split {
                axis: slice.view.axis.unwrap_or(0),
                parts: 1,
            },
        };
        slice.view.describe(placement, self.shape.len())
    }

    /// [`describe`](Self::describe) with the extent: `rows 0..48 of 384`, `the whole [384, 256]`.
    fn extent(&self, slice: &Slice) -> String {
        match slice.view.axis {
            None => format!("the whole {:?}", self.shape),
            Some(a) => format!("{} of {}", self.describe(slice), self.shape[a]),
        }
    }

    /// What rank `rank`'s `shard` is, and whether that is the plan's slice. An error when the
    /// rank is out of range or the shard carries nothing to compare (no values, hash or
    /// statistics) or values that its shape does not hold.
    pub fn identify(&self, rank: u64, shard: &ObservedShard) -> Result<ShardVerdict> {
        if rank >= self.tp {
            bail!("{}: rank {rank} of {}", self.label, self.tp);
        }
        let n = elements(shard.shape);
        if let Some(v) = shard.values {
            if n != Some(v.len() as u64) {
                bail!(
                    "{}: {} values for shape {:?}",
                    self.label,
                    v.len(),
                    shard.shape
                );
            }
        } else if shard.hash.is_none() && shard.stats.is_none() {
            bail!(
                "{} on rank {rank}: no values, hash or statistics to compare",
                self.label
            );
        }
        let expected = self.planned(rank);
        let first = self
            .candidates
            .iter()
            .position(|c| Some(c) == expected.as_ref());
        // The plan's slice first: where two slices hold equal values, the plan's wins.
        let order: Vec<usize> = first
            .into_iter()
            .chain((0..self.candidates.len()).filter(|&i| Some(i) != first))
            .filter(|&i| Some(self.candidates[i].view.elements(self.shape)) == n)
            .collect();
        let (found, basis) = self.recognise(&order, shard);
        Ok(self.verdict(
            rank,
            expected,
            found.map(|i| self.candidates[i].clone()),
            basis,
            shard,
        ))
    }

    /// The index of the candidate `shard` is among `order`, and on what basis.
    fn recognise(&self, order: &[usize], shard: &ObservedShard) -> (Option<usize>, Basis) {
        if order.is_empty() {
            return (None, Basis::Size);
        }
        let dtype = shard.dtype;
        if let Some(observed) = shard.values {
            let within = |i: usize| {
                let reference = self.values_of(&self.candidates[i]);
                observed.iter().zip(reference.iter()).all(|(&o, &r)| {
                    let (o, r) = (f64::from(o), f64::from(r));
                    (o - r).abs() <= dtype.rel() * r.abs() + dtype.floor()
                })
            };
            return (order.iter().copied().find(|&i| within(i)), Basis::Values);
        }
        if let Some(h) = shard.hash {
            let same = |i: usize| dtype.hash(&self.values_of(&self.candidates[i])) == h;
            if let Some(i) = order.iter().copied().find(|&i| same(i)) {
                return (Some(i), Basis::Hash);
            }
        }
        let Some(observed) = shard.stats else {
            return (None, Basis::Hash);
        };
        let all = self.stats.get_or_init(|| {
            self.candidates
                .iter()
                .map(|c| ShardStats::of(&self.values_of(c)))
                .collect()
        });
        let (best, distance) = order
            .iter()
            .map(|&i| (i, observed.distance(&all[i], dtype)))
            .fold(
                (order[0], f64::INFINITY),
                |a, b| if b.1 < a.1 { b } else { a },
            );
        let found = (distance <= 1.0).then_some(best);
        (found, Basis::Stats { distance })
    }

    /// `the plan gives rows 48..96` / `the plan gives it to rank 2 only`.
    fn plan_text(&self, expected: &Option<Slice>) -> String {
        match (expected, self.owner) {
            (Some(e), _) => format!("the plan gives {}", self.describe(e)),
            (None, Some(o)) => format!("the plan gives it to rank {o} only"),
            (None, None) => "the plan gives it nothing".into(),
        }
    }

    fn verdict(
        &self,
        rank: u64,
        expected: Option<Slice>,
        found: Option<Slice>,
        basis: Basis,
        shard: &ObservedShard,
    ) -> ShardVerdict {
        let who = format!("{} on rank {rank}", self.label);
        let plan = self.plan_text(&expected);
        let (class, evidence) = match &found {
            None => (
                Some(FaultClass::Unknown),
                self.unidentified(&who, &plan, basis, shard),
            ),
            Some(f) => {
                let natural = self.shape_of(f);
                let shaped = if natural == shard.shape {
                    String::new()
                } else {
                    format!(" viewed as {:?}", shard.shape)
                };
                let holds = self.extent(f);
                let hash_missed = shard.hash.is_some() && matches!(basis, Basis::Stats { .. });
                if Some(f) == expected.as_ref() && hash_missed {
                    // Equal statistics prove only the same values; the hash, which matched no
                    // slice, says their order or their rounding is another.
                    let e = format!(
                        "{who}: its statistics are those of {holds}, the planned slice, but its {} \
                         hash matches no slice of the weight: the planned values in another order \
                         (rows or heads moved, a reshape where a transpose belongs) or rounded \
                         otherwise",
                        shard.dtype.name()
                    );
                    (Some(FaultClass::WeightLayout), e)
                } else if Some(f) == expected.as_ref() {
                    if shaped.is_empty() {
                        (None, format!("{who} holds {holds} as planned"))
                    } else {
                        let e = format!("{who} holds {holds}{shaped}; the plan gives {natural:?}");
                        (Some(FaultClass::WrongShardLayout), e)
                    }
                } else {
                    let what = match f.kind {
                        SliceKind::Whole => String::new(),
                        SliceKind::Planned(q) => format!(" (rank {q}'s block)"),
                        SliceKind::OtherAxis(_) => ", split along the wrong axis".into(),
                        SliceKind::Contiguous(_) => {
                            ", one contiguous block where the plan takes one of each merged part"
                                .into()
                        }
                    };
                    let class = match (f.kind, &expected) {
                        (SliceKind::Whole, Some(_)) => FaultClass::UnshardedWeight,
                        _ => FaultClass::WrongShardLayout,
                    };
                    (
                        Some(class),
                        format!("{who} holds {holds}{what}{shaped}; {plan}"),
                    )
                }
            }
        };
        ShardVerdict {
            rank,
            expected,
            found,
            basis,
            class,
            evidence,
        }
    }

    fn unidentified(&self, who: &str, plan: &str, basis: Basis, shard: &ObservedShard) -> String {
        let dtype = shard.dtype.name();
        match basis {
            Basis::Size => format!(
                "{who} holds {:?}, the size of no slice of {:?}; {plan}",
                shard.shape, self.shape
            ),
            Basis::Values => {
                format!("{who} matches no slice of the weight within {dtype} rounding; {plan}")
            }
            Basis::Hash => {
                format!("{who}: its {dtype} hash matches no slice of the weight; {plan}")
            }
            Basis::Stats { distance } => format!(
                "{who}: its statistics match no slice of the weight (the nearest is {distance:.1} \
                 {dtype} roundings away); {plan}"
            ),
        }
    }

    /// Every rank holding the same planned block is an unsharded weight rather than ranks in
    /// the wrong order: given one verdict per rank, reclassify those that hold another rank's
    /// block when all of them found the same one.
    pub fn same_block_everywhere(&self, verdicts: &mut [ShardVerdict]) {
        let every_rank = (0..self.tp).all(|r| verdicts.iter().any(|v| v.rank == r));
        let Some(first) = verdicts.first().and_then(|v| v.found.clone()) else {
            return;
        };
        let same = verdicts.iter().all(|v| v.found.as_ref() == Some(&first));
        if self.tp < 2 || !every_rank || !same || !matches!(first.kind, SliceKind::Planned(_)) {
            return;
        }
        let holds = self.extent(&first);
        for v in verdicts.iter_mut().filter(|v| v.expected != v.found) {
            v.class = Some(FaultClass::UnshardedWeight);
            v.evidence = format!(
                "{} on rank {} holds {holds}, the same block as every rank; {}",
                self.label,
                v.rank,
                self.plan_text(&v.expected)
            );
        }
    }
}

fn whole() -> RankView {
    RankView {
        axis: None,
        pieces: vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `[8, 4]` weight of distinct values, split 4 ways along `axis`.
    fn weight() -> (Vec<f32>, Vec<u64>) {
        ((0..32).map(|v| v as f32 * 0.37 - 5.0).collect(), vec![8, 4])
    }

    fn rows() -> Placement {
        Placement::Split { axis: 0, parts: 1 }
    }

    fn judge(r: &Reference, rank: u64, slice: &Slice, shape: &[u64]) -> ShardVerdict {
        let v = r.values_of(slice);
        r.identify(rank, &ObservedShard::values(shape, Dtype::F32, &v))
            .unwrap()
    }

    #[test]
    fn values_name_the_plan_another_rank_the_whole_and_the_wrong_axis() {
        let (w, s) = weight();
        let r = Reference::new("w", &w, &s, rows(), 4).unwrap();
        let planned = |q| r.planned(q).unwrap();
        let ok = judge(&r, 1, &planned(1), &[2, 4]);
        assert_eq!(
            (ok.class, ok.found, ok.basis),
            (None, Some(planned(1)), Basis::Values)
        );
        assert_eq!(ok.evidence, "w on rank 1 holds rows 2..4 of 8 as planned");

        let other = judge(&r, 3, &planned(0), &[2, 4]);
        assert_eq!(other.class, Some(FaultClass::WrongShardLayout));
        assert_eq!(
            other.evidence,
            "w on rank 3 holds rows 0..2 of 8 (rank 0's block); the plan gives rows 6..8"
        );

        let all = Slice {
            kind: SliceKind::Whole,
            view: whole(),
        };
        let whole_ = judge(&r, 2, &all, &[8, 4]);
        assert_eq!(whole_.class, Some(FaultClass::UnshardedWeight));
        assert_eq!(
            whole_.evidence,
            "w on rank 2 holds the whole [8, 4]; the plan gives rows 4..6"
        );

        // Column 2 of every row, shaped as the planned [2, 4].
        let col = Slice {
            kind: SliceKind::OtherAxis(2),
            view: rank_view(Placement::Split { axis: 1, parts: 1 }, &s, 2, 4).unwrap(),
        };
        assert_eq!(r.values_of(&col).len(), 8);
        let axis = judge(&r, 2, &col, &[2, 4]);
        assert_eq!(axis.found, Some(col));
        assert_eq!(axis.class, Some(FaultClass::WrongShardLayout));
        assert_eq!(
            axis.evidence,
            "w on rank 2 holds cols 2..3 of 4, split along the wrong axis viewed as [2, 4]; \
             the plan gives rows 4..6"
        );
    }

    #[test]
    fn every_rank_holding_one_block_is_unsharded() {
        let (w, s) = weight();
        let r = Reference::new("w", &w, &s, rows(), 4).unwrap();
        let block0 = r.planned(0).unwrap();
        let mut vs: Vec<_> = (0..4).map(|q| judge(&r, q, &block0, &[2, 4])).collect();
        r.same_block_everywhere(&mut vs);
        let classes: Vec<_> = vs.iter().map(|v| v.class).collect();
        let u = Some(FaultClass::UnshardedWeight);
        assert_eq!(classes, vec![None, u, u, u]);
        assert_eq!(
            vs[3].evidence,
            "w on rank 3 holds rows 0..2 of 8, the same block as every rank; the plan gives rows 6..8"
        );
        // Reversed ranks stay a layout fault.
        let mut rev: Vec<_> = (0..4)
            .map(|q| judge(&r, q, &r.planned(3 - q).unwrap(), &[2, 4]))
            .collect();
        r.same_block_everywhere(&mut rev);
        assert!(rev
            .iter()
            .all(|v| v.class == Some(FaultClass::WrongShardLayout)));
    }

    #[test]
    fn merged_halves_taken_as_one_block_are_a_layout_fault() {
        let (w, s) = weight();
        let merged = Placement::Split { axis: 0, parts: 2 };
        let r = Reference::new("gate_up", &w, &s, merged, 2).unwrap();
        assert_eq!(r.describe(&r.planned(1).unwrap()), "rows 2..4 + 6..8");
        let block = Slice {
            kind: SliceKind::Contiguous(1),
            view: rank_view(rows(), &s, 1, 2).unwrap(),
        };
        let v = judge(&r, 1, &block, &[4, 4]);
        assert_eq!(v.found, Some(block));
        assert_eq!(v.class, Some(FaultClass::WrongShardLayout));
        assert!(
            v.evidence.contains("rows 4..8 of 8, one contiguous block"),
            "{}",
            v.evidence
        );
    }

    #[test]
    fn hashes_and_statistics_identify_in_bf16() {
        let w: Vec<f32> = (0..64)
            .map(|v| ((v * 37 % 64) as f32 - 30.0) / 7.0)
            .collect();
        let s = [16u64, 4];
        let r = Reference::new("w", &w, &s, rows(), 4).unwrap();
        let block2 = r.values_of(&r.planned(2).unwrap());
        let bf: Vec<f32> = block2.iter().map(|&x| Dtype::Bf16.round(x)).collect();
        let stats = ShardStats::of(&bf);
        let by_hash = ObservedShard {
            shape: &[4, 4],
            dtype: Dtype::Bf16,
            values: None,
            hash: Some(Dtype::Bf16.hash(&block2)),
            stats: None,
        };
        let v = r.identify(1, &by_hash).unwrap();
        assert_eq!(
            (v.basis, v.found.unwrap().kind),
            (Basis::Hash, SliceKind::Planned(2))
        );
        // A hash that matches nothing falls back to the statistics.
        let by_stats = ObservedShard {
            hash: Some(1),
            stats: Some(&stats),
            ..by_hash
        };
        let v = r.identify(1, &by_stats).unwrap();
        assert_eq!(v.found.unwrap().kind, SliceKind::Planned(2));
        assert!(matches!(v.basis, Basis::Stats { distance } if distance <= 1.0));
        // Values rounded to bf16 are within bf16's rounding of ours, not f32's.
        let ok = r.identify(2, &ObservedShard::values(&[4, 4], Dtype::Bf16, &bf));
        assert_eq!(ok.unwrap().class, None);
        let strict = r.identify(2, &ObservedShard::values(&[4, 4], Dtype::F32, &bf));
        assert_eq!(strict.unwrap().class, Some(FaultClass::Unknown));
        // Statistics far from every slice: unidentified, nearest distance reported.
        let off = ShardStats {
            max: stats.max * 1.5,
            ..stats.clone()
        };
        let v = r
            .identify(
                2,
                &ObservedShard {
                    hash: None,
                    stats: Some(&off),
                    ..by_hash
                },
            )
            .unwrap();
        assert_eq!((v.found, v.class), (None, Some(FaultClass::Unknown)));
        assert!(v.evidence.contains("roundings away"), "{}", v.evidence);
    }

    #[test]
    fn planned_values_in_another_shape_sizes_no_slice_has_and_ep_owners() {
        let (w, s) = weight();
        let r = Reference::new("w", &w, &s, rows(), 4).unwrap();
        let planned = r.values_of(&r.planned(1).unwrap());
        let reshaped = r
            .identify(1, &ObservedShard::values(&[4, 2], Dtype::F32, &planned))
            .unwrap();
        assert_eq!(reshaped.class, Some(FaultClass::WrongShardLayout));
        assert_eq!(
            reshaped.evidence,
            "w on rank 1 holds rows 2..4 of 8 viewed as [4, 2]; the plan gives [2, 4]"
        );
        let odd = ObservedShard::values(&[3, 4], Dtype::F32, &w[..12]);
        let v = r.identify(0, &odd).unwrap();
        assert_eq!((v.basis, v.class), (Basis::Size, Some(FaultClass::Unknown)));
        assert!(r.identify(4, &odd).is_err());
        assert!(Reference::new("w", &w, &s, rows(), 3).is_err());

        let e = Reference::owned("expert", &w, &s, 1, 2).unwrap();
        let on = e
            .identify(1, &ObservedShard::values(&s, Dtype::F32, &w))
            .unwrap();
        assert_eq!(on.class, None);
        let off = e
            .identify(0, &ObservedShard::values(&s, Dtype::F32, &w))
            .unwrap();
        assert_eq!(off.class, Some(FaultClass::WrongShardLayout));
        assert_eq!(
            off.evidence,
            "expert on rank 0 holds the whole [8, 4]; the plan gives it to rank 1 only"
        );
    }

    #[test]
    fn gather_takes_pieces_of_every_outer_index() {
        let w: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let view = RankView {
            axis: Some(1),
            pieces: vec![0..1, 2..3],
        };
        assert_eq!(view_shape(&[2, 4, 3], &view), vec![2, 2, 3]);
        assert_eq!(
            gather(&w, &[2, 4, 3], &view).into_owned(),
            vec![0., 1., 2., 6., 7., 8., 12., 13., 14., 18., 19., 20.]
        );
    }
}
