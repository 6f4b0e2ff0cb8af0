//! docs/design.md §7's fault classes and what a diagnosis carries.

use serde::{Deserialize, Serialize};

/// `fault.class` in JSON; the names are stable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultClass {
    WrongDequant,
    /// A checkpoint tensor far from the reference beyond its type's noise, in no other class's
    /// relation (garbage blocks, zeroed blocks, rows of another tensor).
    CorruptWeight,
    UnshardedWeight,
    WrongShardLayout,
    MissingAllReduce,
    ExtraAllReduce,
    DtypeOverflow,
    NanOrigin,
    WeightLayout,
    RopeMismatch,
    RouterMismatch,
    /// The DSA indexer chooses other keys than the reference beyond near ties (its `top_k`,
    /// weights or rotary embedding).
    IndexerMismatch,
    ScaleMismatch,
    /// An RMSNorm's epsilon differs (a GGUF's `layer_norm_rms_epsilon`).
    NormEpsMismatch,
    FlatLogits,
    PrecisionLoss,
    /// A server's answer for one request moves when other requests run beside it (`endpoint
    /// --concurrency`): requests that see each other's tokens, or kernels wrong for some batch
    /// shapes.
    ConcurrencyDependence,
    Unknown,
}

impl FaultClass {
    pub fn name(self) -> &'static str {
        match self {
            FaultClass::WrongDequant => "wrong_dequant",
            FaultClass::CorruptWeight => "corrupt_weight",
            FaultClass::UnshardedWeight => "unsharded_weight",
            FaultClass::WrongShardLayout => "wrong_shard_layout",
            FaultClass::MissingAllReduce => "missing_all_reduce",
            FaultClass::ExtraAllReduce => "extra_all_reduce",
            FaultClass::DtypeOverflow => "dtype_overflow",
            FaultClass::NanOrigin => "nan_origin",
            FaultClass::WeightLayout => "weight_layout",
            FaultClass::RopeMismatch => "rope_mismatch",
            FaultClass::RouterMismatch => "router_mismatch",
            FaultClass::IndexerMismatch => "indexer_mismatch",
            FaultClass::ScaleMismatch => "scale_mismatch",
            FaultClass::NormEpsMismatch => "norm_eps_mismatch",
            FaultClass::FlatLogits => "flat_logits",
            FaultClass::PrecisionLoss => "precision_loss",
            FaultClass::ConcurrencyDependence => "concurrency_dependence",
            FaultClass::Unknown => "unknown",
        }
    }
}

/// A diagnosis: the class, one sentence, and the facts it rests on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fault {
    pub class: FaultClass,
    pub summary: String,
    pub evidence: Vec<String>,
    /// The weight to blame, when a check names one.
    pub weight: Option<String>,
}
