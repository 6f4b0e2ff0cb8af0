//! Faults planted in a candidate run (`--inject NAME[=ARG]`): one catalogue for every backend.
//! Each entry names the class and the stage a correct diagnosis gives, so that the diagnosis
//! itself can be tested against known bugs (the fault matrix) and shown on demand (the demo).

use anyhow::{bail, Result};
use serde::Serialize;

use crate::compare::fault::FaultClass;
use crate::dtype::Precision;
use crate::model::config::TopkMethod;
use crate::model::names::LayerWeight::{self, *};
use crate::model::stages::stage_of;
use crate::model::Glm5Config;
use crate::model::Stage;

/// A fault planted in the candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Injection {
    /// A ColumnParallel weight loaded whole: every rank uses rank 0's rows.
    UnshardedColumn(LayerWeight),
    /// A split weight cut along its other axis and viewed in the planned shape.
    ShardAxis(LayerWeight),
    /// Each rank given the shard of rank `tp − 1 − r`.
    RankOrder(LayerWeight),
    /// o_proj's all-reduce left out (in one layer, or all): each rank keeps its partial sum.
    SkipAllReduce(Option<u64>),
    /// o_proj's all-reduce run twice: the already-reduced sum summed again over the ranks.
    DoubleAllReduce(Option<u64>),
    /// Q4_K dequantized with sub-blocks 4–7's 6-bit scales and mins read as 0–3's are packed.
    DequantQ4kScales,
    /// f16 without vLLM's residual rescaling (by `1/routed_scaling_factor`).
    Fp16Overflow,
    /// The MLA rotary embedding in the other pair order (NeoX halves on GLM-5).
    RopeNeox,
    /// The DSA indexer's rotary embedding in the other pair order (DeepSeek-V3.2's NeoX halves
    /// on GLM-5's interleaved indexer, or the reverse).
    IndexerRopeNeox,
    /// Routing scores by softmax instead of the configured sigmoid.
    RouterSoftmax,
    /// `routed_scaling_factor` applied to the routed output a second time.
    RoutedScaleTwice,
    /// The expert-group limit left out: every group competes (`n_group`/`topk_group` unread).
    GroupLimitIgnored,
    /// Groups ranked by the other rule: their best score where the model sums their two best
    /// (`noaux_tc`), or the reverse (`group_limited_greedy`).
    GroupScoreSwapped,
    /// YaRN's mscale² left out of the attention's softmax scale (the rotary embedding's own
    /// mscale kept).
    YarnMscaleDropped,
    /// kv_b assembled as every head's K rows, then every head's V rows, instead of per head.
    KvBSplitOrder,
    /// lm_head never loaded: all zeros.
    FlatLmHead,
    /// One routed expert (the first the first token chooses) returns a NaN in this MoE layer.
    NanExpert(Option<u64>),
}

/// One catalogue entry: what `glmcheck bisect --list-faults` prints.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Entry {
    pub name: &'static str,
    /// What ARG selects and its default.
    pub arg: &'static str,
    /// The class a correct diagnosis gives.
    pub class: FaultClass,
    /// Where it first shows (with the default ARG), in words.
    pub stage: &'static str,
    /// Exists only with tensor parallelism.
    pub needs_tp: bool,
    /// Needs this dtype.
    pub dtype: Option<&'static str>,
    pub what: &'static str,
}

const fn entry(
    name: &'static str,
    arg: &'static str,
    class: FaultClass,
    stage: &'static str,
    needs_tp: bool,
    what: &'static str,
) -> Entry {
    Entry {
        name,
        arg,
        class,
        stage,
        needs_tp,
        dtype: None,
        what,
    }
}

/// Every fault, in the order of the listing.
pub const CATALOGUE: &[Entry] = &[
    entry(
        "unsharded-column",
        "WEIGHT: q_b, kv_b, gate, up, shared_gate, shared_up (default kv_b)",
        FaultClass::UnshardedWeight,
        "the weight's stage in layer 0 (L0.attn.kv)",
        true,
        "a ColumnParallel weight loaded whole on every rank, each rank using rank 0's rows",
    ),
    entry(
        "shard-axis",
        "WEIGHT: any split weight, also o_proj, down, shared_down (default kv_b)",
        FaultClass::WrongShardLayout,
        "the weight's stage in layer 0 (L0.attn.kv)",
        true,
        "a weight split along its other axis and viewed in the planned shape",
    ),
    entry(
        "rank-order",
        "WEIGHT: any split weight (default kv_b)",
        FaultClass::WrongShardLayout,
        "the weight's stage in layer 0 (L0.attn.kv)",
        true,
        "shards given to the ranks in reverse order",
    ),
    entry(
        "skip-all-reduce",
        "LAYER (default every layer)",
        FaultClass::MissingAllReduce,
        "L{layer}.attn.out",
        true,
        "o_proj's all-reduce left out: each rank continues with its partial sum",
    ),
    entry(
        "double-all-reduce",
        "LAYER (default every layer)",
        FaultClass::ExtraAllReduce,
        "L{layer}.attn.out",
        true,
        "o_proj's all-reduce run twice",
    ),
    entry(
        "dequant-q4k-scales",
        "none",
        FaultClass::WrongDequant,
        "the first stage reading a Q4_K weight",
        false,
        "the Q4_K dequantizer unpacks the 6-bit scales and mins of sub-blocks 4–7 as 0–3's",
    ),
    Entry {
        dtype: Some("f16"),
        ..entry(
            "fp16-overflow",
            "none",
            FaultClass::DtypeOverflow,
            "the first stage past 65504 (a residual sum)",
            false,
            "f16 without vLLM's residual rescaling, on a model whose residual stream leaves the \
             f16 range",
        )
    },
    entry(
        "rope-neox",
        "none",
        FaultClass::RopeMismatch,
        "L0.attn.q_rope",
        false,
        "NeoX (halves) instead of interleaved pairs in MLA's rotary embedding",
    ),
    entry(
        "indexer-rope-neox",
        "none",
        FaultClass::IndexerMismatch,
        "L0.attn.index_topk (attn.ctx where the dtype's own noise flips the same choices)",
        false,
        "the DSA indexer's rotary embedding in the other pair order (DeepSeek-V3.2's halves on \
         GLM-5's adjacent pairs), so it keeps other key positions",
    ),
    entry(
        "router-softmax",
        "none",
        FaultClass::RouterMismatch,
        "L{first MoE}.moe.topk_ids (topk_weights where no choice changes)",
        false,
        "routing scores by softmax instead of sigmoid",
    ),
    entry(
        "group-limit-ignored",
        "none (the model needs expert groups: DeepSeek-V2/V3)",
        FaultClass::RouterMismatch,
        "L{first MoE}.moe.topk_ids (topk_weights where no choice changes)",
        false,
        "the router chooses among every expert group, not only the best topk_group",
    ),
    entry(
        "group-score-swapped",
        "none (the model needs expert groups: DeepSeek-V2/V3)",
        FaultClass::RouterMismatch,
        "L{first MoE}.moe.topk_ids (topk_weights where no choice changes)",
        false,
        "expert groups ranked by their best score where the model sums their two best \
         (noaux_tc, DeepSeek-V3), or the reverse (DeepSeek-V2's group_limited_greedy)",
    ),
    entry(
        "routed-scale-twice",
        "none",
        FaultClass::ScaleMismatch,
        "L{first MoE}.moe.routed",
        false,
        "routed_scaling_factor applied to the routed experts' output a second time",
    ),
    entry(
        "yarn-mscale-dropped",
        "none (the model needs YaRN with mscale_all_dim: DeepSeek-V3, Kimi-K2)",
        FaultClass::ScaleMismatch,
        "L0.attn.ctx",
        false,
        "YaRN's mscale² left out of the attention's softmax scale",
    ),
    entry(
        "kv-b-split-order",
        "none",
        FaultClass::WeightLayout,
        "L0.attn.kv",
        false,
        "kv_b re-assembled as all K rows then all V rows instead of per head",
    ),
    entry(
        "flat-lm-head",
        "none",
        FaultClass::FlatLogits,
        "logits",
        false,
        "lm_head never loaded (zeros): every token equally likely",
    ),
    entry(
        "nan-expert",
        "LAYER (default the first MoE layer)",
        FaultClass::NanOrigin,
        "L{layer}.moe.routed",
        false,
        "one routed expert's output holds a NaN",
    ),
];

/// The short weight names ARG takes.
const WEIGHTS: &[(&str, LayerWeight)] = &[
    ("q_proj", QProj),
    ("q_b", QB),
    ("kv_b", KvB),
    ("o_proj", AttnOut),
    ("gate", Gate),
    ("up", Up),
    ("down", Down),
    ("shared_gate", SharedGate),
    ("shared_up", SharedUp),
    ("shared_down", SharedDown),
];

const COLUMN_PARALLEL: &[LayerWeight] = &[QProj, QB, KvB, Gate, Up, SharedGate, SharedUp];

fn weight_arg(name: &str, arg: Option<&str>, column_only: bool) -> Result<LayerWeight> {
    let arg = arg.unwrap_or("kv_b");
    let allowed: Vec<&str> = WEIGHTS
        .iter()
        .filter(|(_, w)| !column_only || COLUMN_PARALLEL.contains(w))
        .map(|(n, _)| *n)
        .collect();
    match WEIGHTS.iter().find(|(n, _)| *n == arg) {
        Some((_, w)) if allowed.contains(&arg) => Ok(*w),
        _ => bail!(
            "--inject {name}={arg}: the weight is one of {}",
            allowed.join(", ")
        ),
    }
}

fn layer_arg(name: &str, arg: Option<&str>) -> Result<Option<u64>> {
    arg.map(|a| {
        a.trim_start_matches('L')
            .parse()
            .map_err(|_| anyhow::anyhow!("--inject {name}={a}: ARG is a layer number"))
    })
    .transpose()
}

impl Injection {
    /// `NAME[=ARG]` as `--inject` takes it.
    pub fn parse(spec: &str) -> Result<Injection> {
        let (name, arg) = match spec.split_once('=') {
            Some((n, a)) => (n, Some(a)),
            None => (spec, None),
        };
        let no_arg = |i: Injection| match arg {
            Some(a) => bail!("--inject {name} takes no argument (got `{a}`)"),
            None => Ok(i),
        };
        match name {
            "unsharded-column" => Ok(Injection::UnshardedColumn(weight_arg(name, arg, true)?)),
            "shard-axis" => Ok(Injection::ShardAxis(weight_arg(name, arg, false)?)),
            "rank-order" => Ok(Injection::RankOrder(weight_arg(name, arg, false)?)),
            "skip-all-reduce" => Ok(Injection::SkipAllReduce(layer_arg(name, arg)?)),
            "double-all-reduce" => Ok(Injection::DoubleAllReduce(layer_arg(name, arg)?)),
            "nan-expert" => Ok(Injection::NanExpert(layer_arg(name, arg)?)),
            "dequant-q4k-scales" => no_arg(Injection::DequantQ4kScales),
            "fp16-overflow" => no_arg(Injection::Fp16Overflow),
            "rope-neox" => no_arg(Injection::RopeNeox),
            "indexer-rope-neox" => no_arg(Injection::IndexerRopeNeox),
            "router-softmax" => no_arg(Injection::RouterSoftmax),
            "routed-scale-twice" => no_arg(Injection::RoutedScaleTwice),
            "group-limit-ignored" => no_arg(Injection::GroupLimitIgnored),
            "group-score-swapped" => no_arg(Injection::GroupScoreSwapped),
            "yarn-mscale-dropped" => no_arg(Injection::YarnMscaleDropped),
            "kv-b-split-order" => no_arg(Injection::KvBSplitOrder),
            "flat-lm-head" => no_arg(Injection::FlatLmHead),
            _ => bail!(
                "--inject {name}: no such fault; `glmcheck bisect --list-faults` lists them ({})",
                CATALOGUE
                    .iter()
                    .map(|e| e.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    pub fn entry(&self) -> &'static Entry {
        let name = match self {
            Injection::UnshardedColumn(_) => "unsharded-column",
            Injection::ShardAxis(_) => "shard-axis",
            Injection::RankOrder(_) => "rank-order",
            Injection::SkipAllReduce(_) => "skip-all-reduce",
            Injection::DoubleAllReduce(_) => "double-all-reduce",
            Injection::DequantQ4kScales => "dequant-q4k-scales",
            Injection::Fp16Overflow => "fp16-overflow",
            Injection::RopeNeox => "rope-neox",
            Injection::IndexerRopeNeox => "indexer-rope-neox",
            Injection::RouterSoftmax => "router-softmax",
            Injection::RoutedScaleTwice => "routed-scale-twice",
            Injection::GroupLimitIgnored => "group-limit-ignored",
            Injection::GroupScoreSwapped => "group-score-swapped",
            Injection::YarnMscaleDropped => "yarn-mscale-dropped",
            Injection::KvBSplitOrder => "kv-b-split-order",
            Injection::FlatLmHead => "flat-lm-head",
            Injection::NanExpert(_) => "nan-expert",
        };
        CATALOGUE
            .iter()
            .find(|e| e.name == name)
            .expect("every injection has a catalogue entry")
    }

    /// `NAME[=ARG]`, as parsed.
    pub fn spec(&self) -> String {
        let name = self.entry().name;
        let weight = |w: &LayerWeight| WEIGHTS.iter().find(|(_, x)| x == w).map(|(n, _)| *n);
        let arg = match self {
            Injection::UnshardedColumn(w) | Injection::ShardAxis(w) | Injection::RankOrder(w) => {
                weight(w).map(str::to_string)
            }
            Injection::SkipAllReduce(l)
            | Injection::DoubleAllReduce(l)
            | Injection::NanExpert(l) => l.map(|l| l.to_string()),
            _ => None,
        };
        match arg {
            Some(a) => format!("{name}={a}"),
            None => name.to_string(),
        }
    }

    /// A usage error where the fault cannot exist in this run.
    pub fn check(&self, cfg: &Glm5Config, tp: usize, precision: Precision) -> Result<()> {
        let e = self.entry();
        if e.needs_tp && tp < 2 {
            bail!(
                "--inject {}: needs tensor parallelism (--tp 2 or more)",
                e.name
            );
        }
        if let Some(d) = e.dtype {
            if precision.name() != d {
                bail!("--inject {}: needs --dtype {d}", e.name);
            }
        }
        let layers = cfg.num_hidden_layers;
        match self {
            Injection::SkipAllReduce(Some(l)) | Injection::DoubleAllReduce(Some(l))
                if *l >= layers =>
            {
                bail!("--inject {}: layer {l} of {layers}", e.name)
            }
            Injection::NanExpert(Some(l)) if !cfg.is_moe_layer(*l) => {
                bail!("--inject nan-expert={l}: layer {l} is not a MoE layer")
            }
            Injection::NanExpert(None) | Injection::RouterSoftmax | Injection::RoutedScaleTwice
                if cfg.first_k_dense_replace >= layers =>
            {
                bail!("--inject {}: the model has no MoE layer", e.name)
            }
            Injection::RoutedScaleTwice if cfg.routed_scaling_factor == 1.0 => {
                bail!("--inject routed-scale-twice: routed_scaling_factor is 1, twice is once")
            }
            Injection::RouterSoftmax if cfg.scoring_func == "softmax" => {
                bail!("--inject router-softmax: the model already scores with softmax")
            }
            // Ranked by their best score, the best `topk_group` groups hold the best
            // `topk_group` experts: with no more chosen, the limit changes nothing.
            Injection::GroupLimitIgnored
                if cfg.topk_method == TopkMethod::GroupLimitedGreedy
                    && cfg.num_experts_per_tok <= cfg.topk_group =>
            {
                bail!(
                    "--inject {}: with {} experts chosen from the best {} groups by their best \
                     score, the limit never changes a choice",
                    e.name,
                    cfg.num_experts_per_tok,
                    cfg.topk_group
                )
            }
            Injection::GroupLimitIgnored | Injection::GroupScoreSwapped
                if cfg.n_group < 2
                    || cfg.topk_group >= cfg.n_group
                    || cfg.topk_method == TopkMethod::Greedy
                    || cfg.first_k_dense_replace >= layers =>
            {
                bail!(
                    "--inject {}: the model limits no expert groups (n_group {}, topk_group {}, \
                     topk_method {})",
                    e.name,
                    cfg.n_group,
                    cfg.topk_group,
                    cfg.topk_method.name()
                )
            }
            Injection::YarnMscaleDropped if cfg.yarn_softmax_factor() == 1.0 => {
                bail!(
                    "--inject {}: the model's softmax scale has no YaRN mscale² (no YaRN, or \
                     no mscale_all_dim)",
                    e.name
                )
            }
            Injection::IndexerRopeNeox if !cfg.has_indexer(0) => {
                bail!(
                    "--inject {}: the model has no DSA indexer in layer 0",
                    e.name
                )
            }
            _ => Ok(()),
        }
    }

    /// Whether this fault touches layer `l` (faults without a layer touch every layer).
    pub fn in_layer(&self, l: u64) -> bool {
        match self {
            Injection::SkipAllReduce(Some(x)) | Injection::DoubleAllReduce(Some(x)) => *x == l,
            _ => true,
        }
    }

    /// The MoE layer `nan-expert` poisons.
    pub fn nan_layer(&self, cfg: &Glm5Config) -> Option<u64> {
        match self {
            Injection::NanExpert(l) => Some(l.unwrap_or(cfg.first_k_dense_replace)),
            _ => None,
        }
    }

    /// The stages where a correct diagnosis places the first divergence on a model of `cfg`
    /// (several where the model decides; `first_q4k` is the first stage that reads a Q4_K
    /// weight, for `dequant-q4k-scales`).
    pub fn expected_stages(&self, cfg: &Glm5Config, first_q4k: Option<&str>) -> Vec<String> {
        let moe = cfg.first_k_dense_replace;
        let at = |layer: u64, kind: &str| vec![Stage::layer_stage(layer, kind).to_string()];
        match self {
            Injection::UnshardedColumn(w) | Injection::ShardAxis(w) | Injection::RankOrder(w) => {
                let layer = if matches!(w, SharedGate | SharedUp | SharedDown) {
                    moe
                } else {
                    0
                };
                stage_of(cfg, layer, *w).into_iter().collect()
            }
            Injection::SkipAllReduce(l) | Injection::DoubleAllReduce(l) => {
                at(l.unwrap_or(0), "attn.out")
            }
            Injection::DequantQ4kScales => first_q4k.map(str::to_string).into_iter().collect(),
            // Where the residual stream first leaves the range depends on the model.
            Injection::Fp16Overflow => Vec::new(),
            Injection::RopeNeox => at(0, "attn.q_rope"),
            // In bf16 the few choices it changes on a small model can be ones the dtype's own
            // rounding flips too (near ties, taken): the attention they feed is where it shows.
            Injection::IndexerRopeNeox => [at(0, "attn.index_topk"), at(0, "attn.ctx")].concat(),
            Injection::RoutedScaleTwice => at(moe, "moe.routed"),
            // In bf16 the weights, whose ids near ties round alike, may show it first.
            Injection::RouterSoftmax
            | Injection::GroupLimitIgnored
            | Injection::GroupScoreSwapped => {
                [at(moe, "moe.topk_ids"), at(moe, "moe.topk_weights")].concat()
            }
            Injection::YarnMscaleDropped => at(0, "attn.ctx"),
            Injection::KvBSplitOrder => at(0, "attn.kv"),
            Injection::FlatLmHead => vec!["logits".into()],
            Injection::NanExpert(l) => at(l.unwrap_or(moe), "moe.routed"),
        }
    }
}

/// kv_b's rows `[heads × (nope + v), kv_lora]` re-ordered as every head's K rows, then every
/// head's V rows — what an assembler gets wrong when it concatenates `attn_k_b` and `attn_v_b`
/// whole instead of interleaving them per head.
pub fn k_then_v_rows(kv_b: &[f32], heads: usize, nope: usize, v: usize, cols: usize) -> Vec<f32> {
    let per_head = nope + v;
    let row = |h: usize, i: usize| &kv_b[(h * per_head + i) * cols..][..cols];
    let mut out = Vec::with_capacity(kv_b.len());
    for h in 0..heads {
        (0..nope).for_each(|i| out.extend_from_slice(row(h, i)));
    }
    for h in 0..heads {
        (nope..per_head).for_each(|i| out.extend_from_slice(row(h, i)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_parses_and_round_trips() {
        for e in CATALOGUE {
            let i = Injection::parse(e.name).unwrap();
            assert_eq!(i.entry().name, e.name);
            assert_eq!(Injection::parse(&i.spec()).unwrap(), i);
        }
        assert_eq!(
            Injection::parse("unsharded-column=q_b").unwrap(),
            Injection::UnshardedColumn(QB)
        );
        assert!(Injection::parse("unsharded-column=o_proj").is_err());
        assert_eq!(
            Injection::parse("skip-all-reduce=L2").unwrap(),
            Injection::SkipAllReduce(Some(2))
        );
        assert!(Injection::parse("rope-neox=1").is_err());
        assert!(Injection::parse("no-such").is_err());
    }

    #[test]
    fn k_then_v_gathers_each_half_across_heads() {
        // 2 heads, nope 1, v 1, one column: rows k0 v0 k1 v1 → k0 k1 v0 v1.
        assert_eq!(
            k_then_v_rows(&[1., 2., 3., 4.], 2, 1, 1, 1),
            vec![1., 3., 2., 4.]
        );
    }
}
