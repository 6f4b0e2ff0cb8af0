//! The one seam where a planted fault ([`Injection`], the catalogue) changes a run: a named hook
//! for each point of the forward, the tensor-parallel split and the weight source that a fault
//! can reach. With no fault planted each hook returns what the model itself does, so the
//! reference reads as the model and every fault's effect is written here.

use anyhow::Result;

use crate::exec::backend::Backend;
use crate::exec::faults::inject::{k_then_v_rows, Injection, Injection::*};
use crate::exec::mat::Mat;
use crate::model::config::TopkMethod;
use crate::model::names::{LayerWeight, WeightId};
use crate::model::Glm5Config;

/// The hooks of a run with `fault` planted (`None`: the model as it is).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hooks(Option<Injection>);

impl Hooks {
    pub fn new(fault: Option<Injection>) -> Self {
        Hooks(fault)
    }

    /// RoPE's pairing of dimensions: the config's (`rope-neox` takes the other one).
    pub fn rope_interleave(self, configured: bool) -> bool {
        configured != (self.0 == Some(RopeNeox))
    }

    /// The DSA indexer's RoPE pairing: the config's (`indexer-rope-neox` takes the other one).
    pub fn indexer_rope_interleave(self, configured: bool) -> bool {
        configured != (self.0 == Some(IndexerRopeNeox))
    }

    /// The softmax scale's multiplier from YaRN's mscale² (`yarn-mscale-dropped`: 1).
    pub fn yarn_softmax_factor(self, cfg: &Glm5Config) -> f64 {
        match self.0 {
            Some(YarnMscaleDropped) => 1.0,
            _ => cfg.yarn_softmax_factor(),
        }
    }

    /// Whether an f16 run rescales the residual stream as vLLM does (`fp16-overflow` does not).
    pub fn fp16_residual_rescale(self) -> bool {
        self.0 != Some(Fp16Overflow)
    }

    /// Whether the router scores with softmax: as configured (`router-softmax`: always).
    pub fn router_softmax(self, scoring_func: &str) -> bool {
        scoring_func == "softmax" || self.0 == Some(RouterSoftmax)
    }

    /// How many of a group's best scores rank it, as the model's `topk_method` says (0: groups
    /// do not limit); `group-limit-ignored` drops the limit, `group-score-swapped` takes the
    /// other method's count.
    pub fn group_rank_scores(self, method: TopkMethod) -> usize {
        let own = match method {
            TopkMethod::NoauxTc => 2,
            TopkMethod::GroupLimitedGreedy => 1,
            TopkMethod::Greedy => 0,
        };
        match self.0 {
            Some(GroupLimitIgnored) => 0,
            Some(GroupScoreSwapped) if own > 0 => 3 - own,
            _ => own,
        }
    }

    /// Whether layer `l`'s first chosen expert writes a NaN (`nan-expert`).
    pub fn poisons_expert(self, cfg: &Glm5Config, l: u64) -> bool {
        self.0.and_then(|f| f.nan_layer(cfg)) == Some(l)
    }

    /// Whether the routed experts' sum is scaled by `routed_scaling_factor` a second time
    /// (`routed-scale-twice`).
    pub fn routed_scale_again(self) -> bool {
        self.0 == Some(RoutedScaleTwice)
    }

    /// Layer `l`'s o_proj output after its all-reduce: the reduced `sum`; rank 0's own partial
    /// sum where `skip-all-reduce` leaves the collective out; the sum reduced again under
    /// `double-all-reduce`.
    pub fn attn_all_reduce<B: Backend>(
        self,
        be: &B,
        l: u64,
        sum: Mat<B::E>,
        parts: &[Mat<B::E>],
    ) -> Result<Mat<B::E>> {
        Ok(match self.0 {
            Some(f @ SkipAllReduce(_)) if f.in_layer(l) => parts[0].clone(),
            Some(f @ DoubleAllReduce(_)) if f.in_layer(l) => {
                be.all_reduce(&vec![sum; parts.len()])?
            }
            _ => sum,
        })
    }

    /// The rank whose planned slice of split weight `role` rank `rank` of `tp` holds: its own;
    /// rank 0's (`unsharded-column`); the mirror rank's (`rank-order`); or `None`, a block of the
    /// other axis (`shard-axis`).
    pub fn slice_of(self, role: LayerWeight, rank: usize, tp: usize) -> Option<usize> {
        match self.0 {
            Some(UnshardedColumn(f)) if f == role => Some(0),
            Some(RankOrder(f)) if f == role => Some(tp - 1 - rank),
            Some(ShardAxis(f)) if f == role => None,
            _ => Some(rank),
        }
    }

    /// Whether quantized weights are dequantized misreading Q4_K's high scale bits
    /// (`dequant-q4k-scales`).
    pub fn misreads_q4k(self) -> bool {
        self.0 == Some(DequantQ4kScales)
    }

    /// Whether weight `id` reads as zeros (`flat-lm-head`).
    pub fn zeroes(self, id: WeightId) -> bool {
        id == WeightId::LmHead && self.0 == Some(FlatLmHead)
    }

    /// Weight `id` as loaded, rearranged where a fault reorders it (`kv-b-split-order`: each
    /// head's k and v rows in the other order).
    pub fn rearranged(self, cfg: &Glm5Config, id: WeightId, w: Mat) -> Mat {
        match (self.0, id) {
            (Some(KvBSplitOrder), WeightId::Layer(_, LayerWeight::KvB)) => Mat::new(
                w.rows,
                w.cols,
                k_then_v_rows(
                    w.data(),
                    cfg.num_attention_heads as usize,
                    cfg.qk_nope_head_dim as usize,
                    cfg.v_head_dim as usize,
                    w.cols,
                ),
            ),
            _ => w,
        }
    }

    /// Whether a fault changes weight `id`'s values as they are read (so that its stored blocks
    /// cannot stand for it).
    pub fn changes_weight(self, id: WeightId) -> bool {
        self.misreads_q4k()
            || self.zeroes(id)
            || (self.0 == Some(KvBSplitOrder) && matches!(id, WeightId::Layer(_, LayerWeight::KvB)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::names::LayerWeight::{KvB, QB};

    #[test]
    fn without_a_fault_every_hook_is_the_model() {
        let none = Hooks::default();
        assert!(none.rope_interleave(true) && !none.rope_interleave(false));
        assert!(none.indexer_rope_interleave(true) && !none.indexer_rope_interleave(false));
        assert!(none.fp16_residual_rescale());
        assert!(!none.router_softmax("sigmoid") && none.router_softmax("softmax"));
        assert!(!none.routed_scale_again() && !none.misreads_q4k());
        assert_eq!(none.slice_of(KvB, 1, 4), Some(1));
        for id in [WeightId::LmHead, WeightId::Layer(0, KvB)] {
            assert!(!none.zeroes(id) && !none.changes_weight(id));
        }
    }

    #[test]
    fn a_planted_fault_changes_its_own_hook_only() {
        let neox = Hooks::new(Some(RopeNeox));
        assert!(!neox.rope_interleave(true) && neox.router_softmax("softmax"));
        assert!(neox.indexer_rope_interleave(true));
        let indexer = Hooks::new(Some(IndexerRopeNeox));
        assert!(!indexer.indexer_rope_interleave(true) && indexer.rope_interleave(true));
        let unsharded = Hooks::new(Some(UnshardedColumn(KvB)));
        assert_eq!(unsharded.slice_of(KvB, 3, 4), Some(0));
        assert_eq!(unsharded.slice_of(QB, 3, 4), Some(3));
        assert_eq!(
            Hooks::new(Some(RankOrder(KvB))).slice_of(KvB, 0, 4),
            Some(3)
        );
        assert_eq!(Hooks::new(Some(ShardAxis(KvB))).slice_of(KvB, 0, 4), None);
        let flat = Hooks::new(Some(FlatLmHead));
        assert!(flat.zeroes(WeightId::LmHead) && !flat.zeroes(WeightId::Layer(0, KvB)));
        assert!(flat.changes_weight(WeightId::LmHead));
        let split = Hooks::new(Some(KvBSplitOrder));
        assert!(split.changes_weight(WeightId::Layer(2, KvB)));
        assert!(!split.changes_weight(WeightId::Layer(2, QB)));
    }
}
