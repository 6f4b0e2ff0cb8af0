//! One stage's comparison as the report gives it ([`StageDiff`]: status, basis, metrics, each
//! side's shape of values) and a stage's whole values read from a trace: what the diff, the
//! classifier and the per-rank checks share, kept apart from the diff so none imports another.

use anyhow::{Context, Result};
use serde::Serialize;

use super::metrics::Metrics;
use super::unshard::{unshard, Sharding};
use crate::trace::{StageRecord, TensorStats, Trace};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Fail,
}

/// What a stage's comparison rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Basis {
    /// Full tensors on both sides.
    Values,
    /// Statistics only: `rel_diff` is its lower bound from the two norms, and equal content
    /// hashes mean equal tensors.
    Stats,
    /// Top-k id sets per position (order within a position ignored).
    Ids,
}

/// A growth factor as JSON: the number, or `"made here"` for an error on an exact input (JSON
/// has no infinity).
fn amplification_json<S: serde::Serializer>(a: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match a {
        Some(a) if a.is_infinite() => s.serialize_str("made here"),
        Some(a) => s.serialize_f64(*a),
        None => s.serialize_none(),
    }
}

/// One stage (or one rank's part of it) compared.
#[derive(Clone, Debug, Serialize)]
pub struct StageDiff {
    pub stage: String,
    pub layer: Option<u64>,
    pub rank: Option<u32>,
    pub status: Status,
    pub basis: Basis,
    /// `1 − 2Σxy/Σ(x²+y²)` (a lower bound on stats), or for ids the share of positions whose
    /// sets differ. The tolerance that would have passed this stage.
    pub rel_diff: f64,
    pub tolerance: f64,
    /// This stage's `rel_diff` over the previous stage's: ≫ 1 where the error is made here,
    /// infinite where the previous stage matched exactly (JSON: `"made here"`).
    #[serde(serialize_with = "amplification_json")]
    pub amplification: Option<f64>,
    #[serde(flatten)]
    pub metrics: Option<Metrics>,
    pub shape: Vec<u64>,
    #[serde(rename = "ref")]
    pub reference: Side,
    #[serde(rename = "cand")]
    pub candidate: Side,
}

/// What one side's tensor looks like, from its values or its recorded statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Side {
    pub nan: u64,
    pub inf: u64,
    pub absmax: f64,
    pub l2: f64,
}

impl Side {
    pub(super) fn of_stats(s: &TensorStats) -> Side {
        Side {
            nan: s.nan,
            inf: s.inf,
            absmax: s.absmax,
            l2: s.l2,
        }
    }

    pub(super) fn of_values(v: &[f32]) -> Side {
        let finite = v.iter().filter(|x| x.is_finite()).map(|&x| f64::from(x));
        let (absmax, sq) = finite.fold((0f64, 0f64), |(m, q), x| (m.max(x.abs()), q + x * x));
        Side {
            nan: v.iter().filter(|x| x.is_nan()).count() as u64,
            inf: v.iter().filter(|x| x.is_infinite()).count() as u64,
            absmax,
            l2: sq.sqrt(),
        }
    }

    pub fn non_finite(&self) -> u64 {
        self.nan + self.inf
    }
}

/// A stage's whole values when the trace holds them (rank parts unsharded).
pub fn whole_values(trace: &Trace, name: &str) -> Result<Option<(Vec<f32>, Vec<u64>)>> {
    let records: Vec<&StageRecord> = trace.stages().iter().filter(|s| s.name == name).collect();
    if let Some(whole) = records.iter().find(|s| s.rank.is_none()) {
        return Ok(trace.tensor(name, None)?.map(|v| (v, whole.shape.clone())));
    }
    let mut parts = Vec::new();
    let mut shapes = Vec::new();
    let mut ranks: Vec<&&StageRecord> = records.iter().collect();
    ranks.sort_by_key(|s| s.rank);
    for s in &ranks {
        match trace.tensor(name, s.rank)? {
            Some(v) => parts.push(v),
            None => return Ok(None),
        }
        shapes.push(s.shape.clone());
    }
    if parts.is_empty() {
        return Ok(None);
    }
    let sharding = Sharding::of(&ranks[0].dims)?;
    Ok(Some(
        unshard(&sharding, &parts, &shapes).with_context(|| format!("stage {name}"))?,
    ))
}

/// The stage right before `stages[i]` named `name` (whole tensors only).
pub fn input<'s>(stages: &'s [StageDiff], i: usize, name: &str) -> Option<&'s StageDiff> {
    stages[..i]
        .iter()
        .rev()
        .find(|p| p.stage == name && p.rank.is_none())
}
