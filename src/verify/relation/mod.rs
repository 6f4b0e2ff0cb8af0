//! What a departing tensor is to the reference: the relation that explains the departure, and
//! the fault class that relation and the weight's role give.
//!
//! The relations are tried from the most certain to the least: NaN/Inf, zeros, one factor,
//! another tensor's bytes, experts, heads or rows in another order, a transpose, swapped
//! halves; what none explains is garbage, with where it lies. Each check re-reads only the
//! units that departed.

pub mod moved;

use anyhow::Result;
use serde::Serialize;

use super::segments::{Sums, UnitStats, BAND, SEGMENT};
use super::units::{Plan, Unit};
use crate::compare::FaultClass;
use crate::exec::source::WeightSource;
use crate::model::names::{LayerWeight, WeightId};
use crate::weights::{Encoding, GgmlType, TensorEntry};

/// How a candidate tensor relates to the reference's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Relation {
    ScalarMultiple,
    Zeros,
    NanInf,
    ExpertPermutation,
    RowPermutation,
    HeadPermutation,
    Transpose,
    SwappedHalves,
    OtherTensor,
    /// The reference's values of another weight of the same shape in the same layer (two
    /// siblings swapped: gate and up, K and V halves, the two latents).
    OtherWeight,
    GarbageBlocks,
    Shape,
    /// `--exact`: within the type's noise, but not the bytes ggml's quantizer gives.
    NotReproduced,
    /// FP8 block scales that must be UE8M0 (powers of two) and are not ([`super::scales`]).
    ScaleFormat,
}

impl Relation {
    pub fn name(self) -> &'static str {
        match self {
            Relation::ScalarMultiple => "scalar_multiple",
            Relation::Zeros => "zeros",
            Relation::NanInf => "nan_inf",
            Relation::ExpertPermutation => "expert_permutation",
            Relation::RowPermutation => "row_permutation",
            Relation::HeadPermutation => "head_permutation",
            Relation::Transpose => "transpose",
            Relation::SwappedHalves => "swapped_halves",
            Relation::OtherTensor => "other_tensor",
            Relation::OtherWeight => "other_weight",
            Relation::GarbageBlocks => "garbage_blocks",
            Relation::Shape => "shape",
            Relation::NotReproduced => "not_reproduced",
            Relation::ScaleFormat => "scale_format",
        }
    }
}

/// A departing tensor, explained.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    pub tensor: String,
    pub class: FaultClass,
    pub relation: Relation,
    pub summary: String,
    pub evidence: Vec<String>,
    /// The factor of a scalar multiple.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub factor: Option<f64>,
    /// (candidate, reference) experts, heads or rows of a permutation.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub map: Vec<(u64, u64)>,
    /// The other tensor of an `other_weight` relation: the one whose reference values this one
    /// holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub with: Option<String>,
}

/// The class a relation gives a weight of role `id`.
pub fn class_of(relation: Relation, id: WeightId, whole: bool) -> FaultClass {
    let router = matches!(
        id,
        WeightId::Layer(_, LayerWeight::Router | LayerWeight::RouterBias)
    );
    let indexer = matches!(
        id,
        WeightId::Layer(
            _,
            LayerWeight::IndexerQB
                | LayerWeight::IndexerK
                | LayerWeight::IndexerKNorm
                | LayerWeight::IndexerKNormBias
                | LayerWeight::IndexerProj
        )
    );
    match relation {
        Relation::NanInf => FaultClass::NanOrigin,
        _ if router => FaultClass::RouterMismatch,
        _ if indexer => FaultClass::IndexerMismatch,
        Relation::Zeros if id == WeightId::LmHead => FaultClass::FlatLogits,
        Relation::ScalarMultiple | Relation::ScaleFormat => FaultClass::ScaleMismatch,
        Relation::ExpertPermutation
        | Relation::RowPermutation
        | Relation::HeadPermutation
        | Relation::Transpose
        | Relation::SwappedHalves
        | Relation::OtherWeight
        | Relation::Shape => FaultClass::WeightLayout,
        Relation::OtherTensor if whole => FaultClass::WeightLayout,
        Relation::OtherTensor
        | Relation::Zeros
        | Relation::GarbageBlocks
        | Relation::NotReproduced => FaultClass::CorruptWeight,
    }
}

/// The departing tensor of `plan` and what it needs to be re-read.
pub struct Departure<'a> {
    pub reference: &'a WeightSource,
    pub cand: &'a WeightSource,
    pub plan: &'a Plan<'a>,
    pub stats: &'a [UnitStats],
    pub strict: bool,
}

impl Departure<'_> {
    fn t(&self) -> &TensorEntry {
        self.plan.tensor
    }

    fn ty(&self) -> Option<GgmlType> {
        match self.t().encoding {
            Encoding::Ggml(ty) => Some(ty),
            _ => None,
        }
    }

    fn type_name(&self) -> &str {
        self.t().encoding.name()
    }

    fn row_len(&self) -> usize {
        self.t().row_len() as usize
    }

    fn finding(&self, relation: Relation, summary: String, evidence: Vec<String>) -> Finding {
        let whole = self.stats.iter().all(|s| s.beyond == s.segments);
        Finding {
            tensor: self.t().name.clone(),
            class: class_of(relation, self.plan.id, whole),
            relation,
            summary,
            evidence,
            factor: None,
            map: Vec::new(),
            with: None,
        }
    }

    /// Row, column, block and expert of value `at` of unit `u`, in words.
    fn place(&self, u: &Unit, at: usize) -> String {
        let row_len = self.row_len().max(1);
        let row = u.rows.start + (at / row_len) as u64;
        let col = at % row_len;
        let block = self.ty().map_or(1, |t| t.block_size());
        let expert = u
            .expert
            .map(|e| format!(" (expert {e})"))
            .unwrap_or_default();
        format!(
            "row {row}, column {col}: block {} of the row{expert}",
            col / block
        )
    }

    fn totals(&self) -> (u64, u64, Sums) {
        let mut beyond = 0;
        let mut segments = 0;
        let mut sums = Sums::default();
        for s in self.stats {
            beyond += s.beyond;
            segments += s.segments;
            sums.add(&s.beyond_sums);
        }
        (beyond, segments, sums)
    }

    /// Units with a segment past the band.
    fn departing(&self) -> impl Iterator<Item = (&Unit, &UnitStats)> {
        self.plan
            .units
            .iter()
            .zip(self.stats)
            .filter(|(_, s)| s.beyond > 0)
    }

    fn share(&self) -> String {
        let (beyond, segments, _) = self.totals();
        if beyond == segments {
            format!("all {segments} segments of {SEGMENT} values")
        } else {
            format!("{beyond} of {segments} segments of {SEGMENT} values")
        }
    }

    /// The relation that explains the departure.
    pub fn explain(&self) -> Result<Finding> {
        if let Some(f) = self.nonfinite() {
            return Ok(f);
        }
        if let Some(f) = self.zeros() {
            return Ok(f);
        }
        if let Some(f) = self.scalar() {
            return Ok(f);
        }
        if let Some(f) = self.other_tensor()? {
            return Ok(f);
        }
        if let Some(f) = self.other_weight()? {
            return Ok(f);
        }
        if let Some(f) = self.experts()? {
            return Ok(f);
        }
        if let Some(f) = self.rows()? {
            return Ok(f);
        }
        if let Some(f) = self.rearranged()? {
            return Ok(f);
        }
        Ok(self.garbage())
    }

    fn nonfinite(&self) -> Option<Finding> {
        let count: u64 = self.stats.iter().map(|s| s.nonfinite).sum();
        let (u, s) = self
            .plan
            .units
            .iter()
            .zip(self.stats)
            .find(|(_, s)| s.nonfinite > 0)?;
        let at = s.first_nonfinite.unwrap_or(0);
        Some(self.finding(
            Relation::NanInf,
            format!(
                "{} ({}): {count} NaN/Inf values where the reference is finite",
                self.t().name,
                self.type_name()
            ),
            vec![format!(
                "{}: the first NaN/Inf at {}",
                self.t().name,
                self.place(u, at)
            )],
        ))
    }

    fn zeros(&self) -> Option<Finding> {
        let (beyond, _, _) = self.totals();
        let zeros: u64 = self.stats.iter().map(|s| s.beyond_zeros).sum();
        if zeros == 0 || zeros != beyond {
            return None;
        }
        let name = &self.t().name;
        if self.stats.iter().all(|s| s.candidate_all_zero) {
            return Some(self.finding(
                Relation::Zeros,
                format!("{name} is all zeros in the candidate: never loaded"),
                vec![format!(
                    "{name}: every one of {} values is 0; the reference's are not",
                    self.t().numel()
                )],
            ));
        }
        let (u, s) = self.departing().next()?;
        Some(self.finding(
            Relation::Zeros,
            format!("{name}: {} are zeros in the candidate", self.share()),
            vec![format!(
                "{name} ({}): the first zeroed segment at {}; the reference's values there are \
                 not zero",
                self.type_name(),
                self.place(u, s.first_beyond[0].at)
            )],
        ))
    }

    fn scalar(&self) -> Option<Finding> {
        let (_, _, b) = self.totals();
        if b.xx <= 0.0 {
            return None;
        }
        let alpha = b.xc / b.xx;
        let resid = (b.cc - 2.0 * alpha * b.xc + alpha * alpha * b.xx).max(0.0);
        let noise = b.nn.max(1e-12 * b.xx);
        let close = resid <= BAND * alpha * alpha * noise;
        if !close || (alpha - 1.0).abs() < 1e-3 || alpha == 0.0 {
            return None;
        }
        let name = &self.t().name;
        // Against the reference as stored in the candidate's type, a scaled block's factor is
        // exact (its scales were multiplied); against the reference, noise blurs it.
        let factor = if b.qq > 0.0 { b.qc / b.qq } else { alpha };
        let mut evidence = vec![format!(
            "{name}: candidate = {alpha:.4} × reference there; after that factor it departs \
             {:.2e} (rel), within {}'s noise {:.2e}",
            rel(resid, alpha * alpha * 2.0 * b.xx),
            self.type_name(),
            rel(b.nn, 2.0 * b.xx)
        )];
        if b.qq > 0.0 {
            evidence.push(format!(
                "{name}: candidate = {factor:.6} × the reference stored as {} by ggml's quantizer",
                self.type_name()
            ));
        }
        let mut f = self.finding(
            Relation::ScalarMultiple,
            format!(
                "{name} ({}): the reference's values times {factor:.4} in {}",
                self.type_name(),
                self.share()
            ),
            evidence,
        );
        f.factor = Some(factor);
        Some(f)
    }

    fn garbage(&self) -> Finding {
        let name = &self.t().name;
        let worst = self
            .stats
            .iter()
            .flat_map(|s| s.first_beyond.iter().map(|b| b.ratio))
            .fold(0.0, f64::max);
        let first = self
            .departing()
            .next()
            .map(|(u, s)| self.place(u, s.first_beyond.first().map_or(0, |b| b.at)))
            .unwrap_or_default();
        let (_, _, b) = self.totals();
        let (relation, summary) = if self.strict && worst <= BAND {
            (
                Relation::NotReproduced,
                format!(
                    "{name} ({}): {} are not the bytes ggml's quantizer gives the reference's \
                     values (within the type's noise)",
                    self.type_name(),
                    self.share()
                ),
            )
        } else {
            (
                Relation::GarbageBlocks,
                format!(
                    "{name} ({}): {} depart far beyond the type's noise, in no relation to the \
                     reference's values",
                    self.type_name(),
                    self.share()
                ),
            )
        };
        self.finding(
            relation,
            summary,
            vec![
                format!("{name}: the first departing segment at {first}"),
                format!(
                    "{name}: rel_diff {:.3e} there against a noise of {:.3e}; up to {worst:.0}× \
                     the noise storing the reference's values as {} leaves",
                    b.rel_diff(),
                    b.noise(),
                    self.type_name()
                ),
            ],
        )
    }
}

fn rel(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::moved::head_map;
    use super::*;

    #[test]
    fn classes_follow_relation_and_role() {
        let o_proj = WeightId::Layer(2, LayerWeight::AttnOut);
        let bias = WeightId::Layer(1, LayerWeight::RouterBias);
        assert_eq!(
            class_of(Relation::ScalarMultiple, o_proj, true),
            FaultClass::ScaleMismatch
        );
        assert_eq!(
            class_of(Relation::Zeros, bias, true),
            FaultClass::RouterMismatch
        );
        assert_eq!(
            class_of(Relation::NanInf, bias, false),
            FaultClass::NanOrigin
        );
        let indexer_k = WeightId::Layer(0, LayerWeight::IndexerK);
        assert_eq!(
            class_of(Relation::ScalarMultiple, indexer_k, true),
            FaultClass::IndexerMismatch
        );
        assert_eq!(
            class_of(Relation::NanInf, indexer_k, true),
            FaultClass::NanOrigin
        );
        assert_eq!(
            class_of(Relation::Zeros, WeightId::LmHead, true),
            FaultClass::FlatLogits
        );
        assert_eq!(
            class_of(Relation::Zeros, o_proj, false),
            FaultClass::CorruptWeight
        );
        assert_eq!(
            class_of(Relation::ExpertPermutation, o_proj, false),
            FaultClass::WeightLayout
        );
        assert_eq!(
            class_of(Relation::OtherTensor, o_proj, true),
            FaultClass::WeightLayout
        );
        assert_eq!(
            class_of(Relation::OtherTensor, o_proj, false),
            FaultClass::CorruptWeight
        );
    }

    #[test]
    fn rows_moved_by_whole_heads_are_a_head_map() {
        // Heads of 4 rows: head 0 and head 2 swapped.
        let rows: Vec<(u64, u64)> = (0..4).flat_map(|i| [(i, 8 + i), (8 + i, i)]).collect();
        assert_eq!(head_map(&rows, 4), Some(vec![(0, 2), (2, 0)]));
        // A row moved to another offset within its head is no head map.
        assert_eq!(head_map(&[(1, 6)], 4), None);
    }
}
