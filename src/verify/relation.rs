//! What a departing tensor is to the reference: the relation that explains the departure, and
//! the fault class that relation and the weight's role give.
//!
//! The relations are tried from the most certain to the least: NaN/Inf, zeros, one factor,
//! another tensor's bytes, experts, heads or rows in another order, a transpose, swapped
//! halves; what none explains is garbage, with where it lies. Each check re-reads only the
//! units that departed.

use std::collections::HashMap;

use anyhow::Result;
use serde::Serialize;

use super::segments::{compare, restore, Sums, UnitStats, BAND, SEGMENT};
use super::units::{both, candidate_bytes, candidate_values, plan, reference_values, Plan, Unit};
use crate::compare::FaultClass;
use crate::exec::source::WeightSource;
use crate::model::names::{LayerWeight, WeightId};
use crate::model::schema::role;
use crate::rng::SplitMix;
use crate::trace::stats::fnv1a_bytes;
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
        Relation::ScalarMultiple => FaultClass::ScaleMismatch,
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

    /// Departing rows that are byte for byte rows of another tensor of the candidate.
    fn other_tensor(&self) -> Result<Option<Finding>> {
        let t = self.t();
        let Some(ty) = self.ty() else {
            return Ok(None);
        };
        let Some(row_bytes) = ty.bytes_for(t.row_len()) else {
            return Ok(None);
        };
        let rows = self.departing_rows(64);
        if rows.is_empty() {
            return Ok(None);
        }
        let bytes = self.cand.files.bytes(t);
        let row = |b: &[u8], r: u64| -> Option<u64> {
            let s = (r * row_bytes) as usize;
            Some(fnv1a_bytes(b.get(s..s + row_bytes as usize)?))
        };
        let wanted: HashMap<u64, u64> = rows
            .iter()
            .filter_map(|&r| Some((row(bytes, r)?, r)))
            .collect();
        let mut found: Vec<(u64, String, u64)> = Vec::new();
        for other in self.cand.files.tensors() {
            if other.name == t.name
                || other.encoding != t.encoding
                || other.row_len() != t.row_len()
            {
                continue;
            }
            let ob = self.cand.files.bytes(other);
            for r in 0..other.rows() {
                if let Some(&mine) = row(ob, r).and_then(|h| wanted.get(&h)) {
                    found.push((mine, other.name.clone(), r));
                }
            }
            if found.len() >= wanted.len() {
                break;
            }
        }
        let Some((_, source, _)) = found.first().cloned() else {
            return Ok(None);
        };
        let mut from: Vec<(u64, u64)> = found
            .iter()
            .filter(|f| f.1 == source)
            .map(|f| (f.0, f.2))
            .collect();
        from.sort_unstable();
        from.dedup_by_key(|p| p.0);
        if from.len() < wanted.len() {
            return Ok(None);
        }
        let (first, last) = (from[0], from[from.len() - 1]);
        let mut f = self.finding(
            Relation::OtherTensor,
            format!(
                "{}: departing rows are byte for byte rows of {source}",
                t.name
            ),
            vec![format!(
                "{}: rows {}..={} ({} rows) hold the stored bytes of {source}'s rows {}..={}",
                t.name,
                first.0,
                last.0,
                from.len(),
                first.1,
                last.1
            )],
        );
        f.map = from;
        Ok(Some(f))
    }

    /// The reference's values of a sibling: another tensor of the candidate with this one's
    /// shape in the same layer, whose reference values the first departing units hold within
    /// the band. Checked the other way too, to tell a swap from a copy.
    fn other_weight(&self) -> Result<Option<Finding>> {
        let t = self.t();
        let layer = self.plan.id.layer();
        let departing: Vec<&Unit> = self.departing().take(4).map(|(u, _)| u).collect();
        if departing.is_empty() {
            return Ok(None);
        }
        let family = self.cand.layout().family;
        for other in self.cand.files.tensors() {
            // Another expert of the same role is an expert permutation, tried next.
            let same_role_expert = |id: WeightId| match (id, self.plan.id) {
                (WeightId::Expert { which: a, .. }, WeightId::Expert { which: b, .. }) => a == b,
                _ => false,
            };
            let sibling = other.name != t.name
                && other.shape == t.shape
                && role(family, &other.name)
                    .is_some_and(|id| id.layer() == layer && !same_role_expert(id));
            if !sibling {
                continue;
            }
            let Ok(theirs) = plan(self.reference, self.cand, other) else {
                continue;
            };
            let same_rows = |u: &Unit| theirs.units.iter().find(|o| o.rows == u.rows);
            let mut holds_theirs = true;
            for u in &departing {
                let Some(o) = same_rows(u) else {
                    holds_theirs = false;
                    break;
                };
                let x = reference_values(self.reference, o)?;
                let c = candidate_values(self.cand, t, u)?;
                if x.len() != c.len() || !self.holds(&x, &c, candidate_bytes(self.cand, t, u))? {
                    holds_theirs = false;
                    break;
                }
            }
            if !holds_theirs {
                continue;
            }
            // Whether the other tensor holds this one's reference values in turn.
            let u = departing[0];
            let swapped = match same_rows(u) {
                Some(o) => {
                    let x = reference_values(self.reference, u)?;
                    let c = candidate_values(self.cand, other, o)?;
                    let stored = candidate_bytes(self.cand, other, o);
                    x.len() == c.len()
                        && compare(self.ty(), self.row_len(), &x, &c, stored, false)
                            .is_ok_and(|st| st.beyond == 0 && st.nonfinite == 0)
                }
                None => false,
            };
            let (summary, how) = match swapped {
                true => (
                    format!("{} and {}: swapped", t.name, other.name),
                    format!("and {} holds the reference's {}", other.name, t.name),
                ),
                false => (
                    format!("{} holds the reference's {}", t.name, other.name),
                    format!("{} is not this tensor's values either", other.name),
                ),
            };
            let mut f = self.finding(
                Relation::OtherWeight,
                summary,
                vec![format!(
                    "{}: {} hold the reference's {} within {}'s noise; {how}",
                    t.name,
                    self.share(),
                    other.name,
                    self.type_name()
                )],
            );
            f.with = Some(other.name.clone());
            return Ok(Some(f));
        }
        Ok(None)
    }

    /// Rows (of the whole tensor) of the first departing segments, at most `most`.
    fn departing_rows(&self, most: usize) -> Vec<u64> {
        let row_len = self.row_len().max(1);
        let mut rows: Vec<u64> = self
            .departing()
            .flat_map(|(u, s)| {
                s.first_beyond.iter().flat_map(move |b| {
                    let first = b.at / row_len;
                    let last = (b.at + SEGMENT - 1) / row_len;
                    (first..=last).map(move |r| u.rows.start + r as u64)
                })
            })
            .filter(|&r| r < self.t().rows())
            .collect();
        rows.sort_unstable();
        rows.dedup();
        rows.truncate(most);
        rows
    }

    /// Whether `c` (a unit's candidate values) is, within the band, the reference's `x`.
    fn holds(&self, x: &[f32], c: &[f32], stored: Option<&[u8]>) -> Result<bool> {
        let st = compare(self.ty(), self.row_len(), x, c, stored, false)?;
        Ok(st.beyond == 0 && st.nonfinite == 0)
    }

    /// Departing experts that are other experts of the reference.
    fn experts(&self) -> Result<Option<Finding>> {
        if let WeightId::Expert {
            layer,
            expert,
            which,
        } = self.plan.id
        {
            return self.other_expert(layer, expert, which);
        }
        let units = &self.plan.units;
        if units.len() < 2 || units[0].expert.is_none() {
            return Ok(None);
        }
        let mut map = Vec::new();
        for (u, _) in self.departing() {
            let e = u.expert.unwrap_or(0);
            let c = candidate_values(self.cand, self.t(), u)?;
            let stored = candidate_bytes(self.cand, self.t(), u);
            let mut matched = None;
            for other in units.iter().filter(|o| o.expert != u.expert) {
                let x = reference_values(self.reference, other)?;
                if x.len() == c.len() && self.holds(&x, &c, stored)? {
                    matched = other.expert;
                    break;
                }
            }
            match matched {
                Some(m) => map.push((e, m)),
                None => return Ok(None),
            }
        }
        let moved: Vec<String> = map
            .iter()
            .map(|(e, m)| format!("expert {e} holds the reference's expert {m}"))
            .collect();
        let mut f = self.finding(
            Relation::ExpertPermutation,
            format!(
                "{}: {} of {} experts hold other experts' weights",
                self.t().name,
                map.len(),
                units.len()
            ),
            vec![format!(
                "{}: {}; each within {}'s noise of the expert it holds; every other expert is in \
                 place",
                self.t().name,
                moved.join(", "),
                self.type_name()
            )],
        );
        f.map = map;
        Ok(Some(f))
    }

    /// An expert stored as a tensor of its own (a Hugging Face checkpoint's per-expert layout)
    /// that holds another expert of the reference: the first whose values it holds within the
    /// band, trying each of the layer's experts.
    fn other_expert(&self, layer: u64, expert: u64, which: LayerWeight) -> Result<Option<Finding>> {
        let [u] = &self.plan.units[..] else {
            return Ok(None);
        };
        let c = candidate_values(self.cand, self.t(), u)?;
        let stored = candidate_bytes(self.cand, self.t(), u);
        for other in (0..self.reference.cfg.n_routed_experts).filter(|&e| e != expert) {
            let x = self
                .reference
                .expert_matrix(layer, other, which)?
                .into_data();
            if x.len() != c.len() || !self.holds(&x, &c, stored)? {
                continue;
            }
            let mut f = self.finding(
                Relation::ExpertPermutation,
                format!(
                    "{}: expert {expert} holds another expert's weights",
                    self.t().name
                ),
                vec![format!(
                    "{}: layer {layer}'s expert {expert} holds the reference's expert {other} \
                     (within {}'s noise)",
                    self.t().name,
                    self.type_name()
                )],
            );
            f.map = vec![(expert, other)];
            return Ok(Some(f));
        }
        Ok(None)
    }

    /// Departing rows of a unit that are other rows of the reference: heads where the rows of
    /// each head moved together, else rows.
    fn rows(&self) -> Result<Option<Finding>> {
        let row_len = self.row_len();
        let mut map: Vec<(u64, u64)> = Vec::new();
        for (u, _) in self.departing().take(4) {
            let (x, c) = both(self.reference, self.cand, self.t(), u)?;
            match moved_rows(self.ty(), row_len, &x, &c)? {
                Some(moved) => map.extend(
                    moved
                        .into_iter()
                        .map(|(r, o)| (u.rows.start + r as u64, u.rows.start + o as u64)),
                ),
                None => return Ok(None),
            }
        }
        if map.is_empty() {
            return Ok(None);
        }
        let name = &self.t().name;
        if let Some(heads) = self.plan.head_rows.and_then(|hr| head_map(&map, hr)) {
            let shown: Vec<String> = heads
                .iter()
                .map(|(h, o)| format!("head {h} holds the reference's head {o}"))
                .collect();
            let mut f = self.finding(
                Relation::HeadPermutation,
                format!("{name}: attention heads in another order"),
                vec![format!(
                    "{name}: {} ({} rows a head); every row within {}'s noise of the row it holds",
                    shown.join(", "),
                    self.plan.head_rows.unwrap_or(0),
                    self.type_name()
                )],
            );
            f.map = heads;
            return Ok(Some(f));
        }
        let shown: Vec<String> = map
            .iter()
            .take(4)
            .map(|(r, o)| format!("row {r} is the reference's row {o}"))
            .collect();
        let mut f = self.finding(
            Relation::RowPermutation,
            format!("{name}: the reference's rows in another order"),
            vec![format!(
                "{name}: {} rows moved ({}{}); each within {}'s noise of the row it holds",
                map.len(),
                shown.join(", "),
                if map.len() > 4 { ", …" } else { "" },
                self.type_name()
            )],
        );
        f.map = map;
        Ok(Some(f))
    }

    /// A transpose (per head of a 3-D tensor) or the two halves of every row swapped.
    fn rearranged(&self) -> Result<Option<Finding>> {
        let t = self.t();
        let [u] = &self.plan.units[..] else {
            return Ok(None);
        };
        let (x, c) = both(self.reference, self.cand, t, u)?;
        let (slices, a, b) = match t.shape[..] {
            [h, a, b] => (h as usize, a as usize, b as usize),
            [a, b] if a == b => (1, a as usize, b as usize),
            _ => (0, 0, 0),
        };
        let name = &t.name;
        if slices > 0 && a * b * slices == x.len() {
            // The reference's [a, b] slices read column by column, stored in the same shape.
            let mut xt = vec![0f32; x.len()];
            for s in 0..slices {
                let (src, dst) = (&x[s * a * b..][..a * b], &mut xt[s * a * b..][..a * b]);
                for i in 0..a {
                    for j in 0..b {
                        dst[j * a + i] = src[i * b + j];
                    }
                }
            }
            if self.holds(&xt, &c, None)? {
                let per = if slices > 1 { " per head" } else { "" };
                return Ok(Some(self.finding(
                    Relation::Transpose,
                    format!("{name}: the reference's values transposed{per}"),
                    vec![format!(
                        "{name}: each [{a}, {b}] slice holds the reference's slice transposed \
                         (as a converter that skips attn_k_b's per-head transpose writes it); \
                         within {}'s noise",
                        self.type_name()
                    )],
                )));
            }
        }
        let row_len = self.row_len();
        if row_len >= 2 && row_len.is_multiple_of(2) {
            let half = row_len / 2;
            let swapped: Vec<f32> = x
                .chunks(row_len)
                .flat_map(|r| r[half..].iter().chain(&r[..half]).copied())
                .collect();
            if self.holds(&swapped, &c, None)? {
                return Ok(Some(self.finding(
                    Relation::SwappedHalves,
                    format!("{name}: the two halves of every row swapped"),
                    vec![format!(
                        "{name}: columns 0..{half} hold the reference's columns {half}..{row_len} \
                         and the reverse, within {}'s noise",
                        self.type_name()
                    )],
                )));
            }
        }
        Ok(None)
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

/// For each row of `c` that departs from the same row of `x`, the other row of `x` it holds
/// (within the band of `ty`'s noise); `None` when some departing row holds no row of `x`.
pub fn moved_rows(
    ty: Option<GgmlType>,
    row_len: usize,
    x: &[f32],
    c: &[f32],
) -> Result<Option<Vec<(usize, usize)>>> {
    let rows = x.len() / row_len.max(1);
    if rows < 2 || c.len() != x.len() {
        return Ok(None);
    }
    let noise = row_noise(ty, row_len, x)?;
    let sketch_x = sketches(x, row_len);
    let sketch_c = sketches(c, row_len);
    let mut moved = Vec::new();
    for r in 0..rows {
        let (xr, cr) = (&x[r * row_len..][..row_len], &c[r * row_len..][..row_len]);
        if within(xr, cr, noise[r]) {
            continue;
        }
        let best = (0..rows)
            .filter(|&o| o != r)
            .min_by(|&a, &b| {
                distance(&sketch_c[r], &sketch_x[a])
                    .total_cmp(&distance(&sketch_c[r], &sketch_x[b]))
            })
            .filter(|&o| within(&x[o * row_len..][..row_len], cr, noise[o]));
        match best {
            Some(o) => moved.push((r, o)),
            None => return Ok(None),
        }
    }
    Ok(Some(moved))
}

/// Per row, the noise Σ(x−q)² storing it in `ty` leaves (0 without a quantizer: exact rows).
fn row_noise(ty: Option<GgmlType>, row_len: usize, x: &[f32]) -> Result<Vec<f64>> {
    let restored = match ty {
        Some(ty) => restore(ty, row_len, x)?,
        None => None,
    };
    Ok(match restored {
        Some((q, _)) => x
            .chunks(row_len)
            .zip(q.chunks(row_len))
            .map(|(xr, qr)| {
                xr.iter()
                    .zip(qr)
                    .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
                    .sum()
            })
            .collect(),
        None => x
            .chunks(row_len)
            .map(|r| 1e-4 * r.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>())
            .collect(),
    })
}

/// Whether row `c` is row `x` within the band over `noise`.
fn within(x: &[f32], c: &[f32], noise: f64) -> bool {
    let (mut dd, mut xx) = (0.0, 0.0);
    for (&a, &b) in x.iter().zip(c) {
        let (a, b) = (f64::from(a), f64::from(b));
        dd += (a - b) * (a - b);
        xx += a * a;
    }
    dd <= BAND * noise + 1e-12 * xx + f64::from(f32::MIN_POSITIVE)
}

/// Projections of each row on 8 fixed random ±1 directions: rows close in values are close here.
fn sketches(v: &[f32], row_len: usize) -> Vec<[f64; 8]> {
    let mut rng = SplitMix::new(0x5eed);
    let signs: Vec<[f64; 8]> = (0..row_len)
        .map(|_| std::array::from_fn(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }))
        .collect();
    v.chunks(row_len)
        .map(|row| {
            let mut s = [0f64; 8];
            for (x, sg) in row.iter().zip(&signs) {
                for k in 0..8 {
                    s[k] += f64::from(*x) * sg[k];
                }
            }
            s
        })
        .collect()
}

fn distance(a: &[f64; 8], b: &[f64; 8]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// The heads map when every moved row moved by whole heads to the same place within its head.
fn head_map(rows: &[(u64, u64)], head_rows: u64) -> Option<Vec<(u64, u64)>> {
    let mut heads: Vec<(u64, u64)> = Vec::new();
    for &(r, o) in rows {
        if r % head_rows != o % head_rows {
            return None;
        }
        let pair = (r / head_rows, o / head_rows);
        match heads.iter().find(|p| p.0 == pair.0) {
            Some(p) if p.1 != pair.1 => return None,
            Some(_) => {}
            None => heads.push(pair),
        }
    }
    Some(heads)
}

#[cfg(test)]
mod tests {
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
