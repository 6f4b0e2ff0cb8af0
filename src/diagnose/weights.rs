//! The divergent stage's weights as the candidate reads them against the reference's.
//!
//! The reference's values moved (rows reordered, or rearranged within rows) are a layout fault;
//! a weight of zeros was never loaded. Otherwise, from the same files any difference is the
//! candidate's dequantization (the bytes are the same, so noise is no excuse); from a
//! conversion, a difference beyond what storing the reference's values in the candidate's type
//! leaves of them. Weights are read in row blocks (the embedding and lm_head) or one matrix,
//! one expert, at a time, and tallied as they pass: memory stays at one block.

use std::collections::HashMap;

use anyhow::Result;

use super::CandidateRun;
use crate::compare::{Fault, FaultClass};
use crate::exec::mat::Mat;
use crate::exec::source::WeightSource;
use crate::model::names::{LayerWeight::*, WeightId};
use crate::trace::stats::fnv1a;
use crate::weights::quantize::round_trip;
use crate::weights::{Encoding, GgmlType};

/// How far past its storage type's own noise a converted weight may depart.
const NOISE_FACTOR: f64 = 10.0;

/// Rows of the embedding and lm_head read at a time.
const BLOCK_ROWS: u64 = 8192;

fn is_vector(id: WeightId) -> bool {
    matches!(
        id,
        WeightId::FinalNorm
            | WeightId::Layer(
                _,
                AttnNorm
                    | QANorm
                    | KvANorm
                    | FfnNorm
                    | RouterBias
                    | IndexerKNorm
                    | IndexerKNormBias
            )
    )
}

/// One weight on both sides, tallied block by block.
struct Tally {
    label: String,
    shape: (usize, usize),
    /// Σxy, Σx², Σy² over both sides; Σ over the reference and its storage round trip.
    dot: f64,
    xx: f64,
    yy: f64,
    noise: (f64, f64, f64),
    max_abs: f64,
    absmax_ref: f32,
    differing: u64,
    first: Option<(usize, usize)>,
    cand_all_zero: bool,
    /// Row fingerprints, and an order-free fingerprint of all values, per side.
    rows: [Vec<u64>; 2],
    multiset: [u64; 2],
    /// `[rows, cols]` of each side where they differ (then nothing else is tallied).
    shapes_differ: Option<[(usize, usize); 2]>,
}

impl Tally {
    fn new(label: String, cols: usize) -> Tally {
        Tally {
            label,
            shape: (0, cols),
            dot: 0.0,
            xx: 0.0,
            yy: 0.0,
            noise: (0.0, 0.0, 0.0),
            max_abs: 0.0,
            absmax_ref: 0.0,
            differing: 0,
            first: None,
            cand_all_zero: true,
            rows: [Vec::new(), Vec::new()],
            multiset: [0, 0],
            shapes_differ: None,
        }
    }

    /// The next rows of both sides (`stored`: the candidate's storage type, for a conversion's
    /// noise).
    fn add(&mut self, r: &Mat, c: &Mat, stored: Option<GgmlType>) -> Result<()> {
        let cols = self.shape.1;
        for (i, (x, y)) in r.data().iter().zip(c.data()).enumerate() {
            let (xd, yd) = (f64::from(*x), f64::from(*y));
            self.dot += xd * yd;
            self.xx += xd * xd;
            self.yy += yd * yd;
            self.absmax_ref = self.absmax_ref.max(x.abs());
            self.cand_all_zero &= *y == 0.0;
            if x.to_bits() != y.to_bits() {
                self.differing += 1;
                self.max_abs = self.max_abs.max((xd - yd).abs());
                let at = self.shape.0 * cols + i;
                self.first.get_or_insert((at / cols, at % cols));
            }
        }
        for (side, m) in [r, c].into_iter().enumerate() {
            self.rows[side].extend(m.data().chunks(cols.max(1)).map(fnv1a));
            // A sum of per-value hashes does not depend on the order of the values.
            let mixed = m
                .data()
                .iter()
                .map(|v| fnv1a(std::slice::from_ref(v)))
                .fold(0u64, u64::wrapping_add);
            self.multiset[side] = self.multiset[side].wrapping_add(mixed);
        }
        if let Some(ty) = stored {
            let stored = round_trip(ty, r.data().to_vec(), cols)?;
            for (x, s) in r.data().iter().zip(&stored) {
                let (x, s) = (f64::from(*x), f64::from(*s));
                self.noise.0 += x * s;
                self.noise.1 += x * x;
                self.noise.2 += s * s;
            }
        }
        self.shape.0 += r.rows;
        Ok(())
    }

    fn rel_diff((dot, xx, yy): (f64, f64, f64)) -> f64 {
        if xx + yy > 0.0 {
            1.0 - 2.0 * dot / (xx + yy)
        } else {
            0.0
        }
    }

    /// For each candidate row, a reference row with the same values, when every row has one.
    fn row_permutation(&self) -> Option<Vec<usize>> {
        let mut at: HashMap<u64, Vec<usize>> = HashMap::new();
        for (r, h) in self.rows[0].iter().enumerate().rev() {
            at.entry(*h).or_default().push(r);
        }
        self.rows[1].iter().map(|h| at.get_mut(h)?.pop()).collect()
    }

    fn fault(&self, class: FaultClass, summary: String, evidence: Vec<String>) -> Fault {
        Fault {
            class,
            summary,
            evidence,
            weight: Some(self.label.clone()),
        }
    }

    /// The verdict once every block is in.
    fn verdict(
        &self,
        reference: &WeightSource,
        id: WeightId,
        cand: &CandidateRun,
    ) -> Option<Fault> {
        let label = &self.label;
        let layout = FaultClass::WeightLayout;
        if let Some([(rr, rc), (cr, cc)]) = self.shapes_differ {
            return Some(self.fault(
                layout,
                format!("{label} has another shape in the candidate"),
                vec![format!(
                    "{label}: [{cr}, {cc}] in the candidate, [{rr}, {rc}] in the reference"
                )],
            ));
        }
        if self.differing == 0 {
            return None;
        }
        if let Some(perm) = self.row_permutation() {
            let moved: Vec<(usize, &usize)> =
                perm.iter().enumerate().filter(|(i, p)| i != *p).collect();
            let shown: Vec<String> = moved
                .iter()
                .take(4)
                .map(|(i, p)| format!("row {i} is the reference's row {p}"))
                .collect();
            return Some(self.fault(
                layout,
                format!("{label}: the reference's rows in another order"),
                vec![format!(
                    "{label}: {} of {} rows moved ({}, …); every value is the reference's",
                    moved.len(),
                    self.shape.0,
                    shown.join(", ")
                )],
            ));
        }
        if self.multiset[0] == self.multiset[1] {
            return Some(self.fault(
                layout,
                format!("{label}: the reference's values in another arrangement"),
                vec![format!(
                    "{label}: the same {} values, not row for row: transposed or interleaved \
                     within rows (per-head blocks of kv_b, attn_k_b's transpose)",
                    self.shape.0 * self.shape.1
                )],
            ));
        }
        if self.cand_all_zero {
            return Some(self.fault(
                FaultClass::Unknown,
                format!("{label} is all zeros in the candidate: never loaded"),
                vec![format!(
                    "{label}: every one of {} values is 0 in the candidate; the reference's \
                     absmax is {:e}",
                    self.shape.0 * self.shape.1,
                    self.absmax_ref
                )],
            ));
        }
        let departure = Self::rel_diff((self.dot, self.xx, self.yy));
        if !cand.same_files {
            let noise = Self::rel_diff(self.noise);
            if departure <= NOISE_FACTOR * noise {
                return None;
            }
            let ty = cand.src.storage_type(id).map_or("F32", |t| t.name());
            return Some(self.fault(
                FaultClass::WrongDequant,
                format!(
                    "{label} ({ty}): the candidate's values depart from the reference's beyond \
                     that type's quantization noise"
                ),
                vec![format!(
                    "{label}: rel_diff {departure:.3e} against the reference; storing the \
                     reference's values as {ty} departs {noise:.3e}"
                )],
            ));
        }
        let names = reference.tensor_names(id);
        let (ty, block) = names
            .first()
            .and_then(|n| reference.files.get(n))
            .map(|t| match &t.encoding {
                Encoding::Ggml(ty) => (ty.name().to_string(), ty.block_size()),
                other => (format!("{other:?}"), 1),
            })
            .unwrap_or_else(|| ("?".into(), 1));
        let (row, col) = self.first.unwrap_or((0, 0));
        let start = col / block * block;
        Some(self.fault(
            FaultClass::WrongDequant,
            format!(
                "{label} ({ty}): the candidate's dequantization of the same bytes differs from \
                 the reference's"
            ),
            vec![
                format!(
                    "{} ({ty}): rel_diff {departure:.3e}, max |Δ| {:.3e}, {} of {} values differ",
                    names.join(" + "),
                    self.max_abs,
                    self.differing,
                    self.shape.0 * self.shape.1
                ),
                format!(
                    "first difference at row {row}, column {col}: block {} of the row (elements \
                     {start}..{}), position {} in it",
                    col / block,
                    start + block,
                    col - start
                ),
            ],
        ))
    }
}

/// The candidate's storage type where it is another model's (a conversion's noise).
fn noise_type(cand: &CandidateRun, id: WeightId) -> Option<GgmlType> {
    (!cand.same_files).then(|| cand.src.storage_type(id).unwrap_or(GgmlType::F32))
}

/// `id` tallied from both sides.
fn tally(reference: &WeightSource, cand: &CandidateRun, id: WeightId) -> Result<Tally> {
    let stored = noise_type(cand, id);
    if is_vector(id) {
        let (r, c) = (reference.vector(id)?, cand.src.vector(id)?);
        let mut t = Tally::new(id.to_string(), r.len());
        t.add(&Mat::new(1, r.len(), r), &Mat::new(1, c.len(), c), stored)?;
        return Ok(t);
    }
    if matches!(id, WeightId::Embed | WeightId::LmHead) {
        let vocab = reference.cfg.vocab_size;
        let mut t = Tally::new(id.to_string(), reference.cfg.hidden_size as usize);
        for start in (0..vocab).step_by(BLOCK_ROWS as usize) {
            let rows = start..(start + BLOCK_ROWS).min(vocab);
            let r = reference.matrix_rows(id, rows.clone())?;
            t.add(&r, &cand.src.matrix_rows(id, rows)?, stored)?;
        }
        return Ok(t);
    }
    let (r, c) = (reference.matrix(id)?, cand.src.matrix(id)?);
    let mut t = Tally::new(id.to_string(), r.cols);
    if (r.rows, r.cols) != (c.rows, c.cols) {
        t.shapes_differ = Some([(r.rows, r.cols), (c.rows, c.cols)]);
        return Ok(t);
    }
    t.add(&r, &c, stored)?;
    Ok(t)
}

/// The first weight among `ids` the candidate reads differently.
pub fn check_weights(
    reference: &WeightSource,
    cand: &CandidateRun,
    ids: &[WeightId],
) -> Result<Option<Fault>> {
    for &id in ids {
        match id {
            // The candidate's chosen experts, one at a time.
            WeightId::Layer(l, ExpertsGate) => {
                for &e in &cand.experts {
                    let (r, c) = (reference.expert(l, e)?, cand.src.expert(l, e)?);
                    let roles = [
                        ("gate", ExpertsGate),
                        ("up", ExpertsUp),
                        ("down", ExpertsDown),
                    ];
                    for (((which, role), r), c) in roles.into_iter().zip(r).zip(c) {
                        let role_id = WeightId::Layer(l, role);
                        let mut t = Tally::new(format!("layer {l} expert {e} {which}"), r.cols);
                        t.add(&r, &c, noise_type(cand, role_id))?;
                        if let Some(f) = t.verdict(reference, role_id, cand) {
                            return Ok(Some(f));
                        }
                    }
                }
            }
            // Covered with the gate.
            WeightId::Layer(_, ExpertsUp | ExpertsDown) => {}
            id => {
                if let Some(f) = tally(reference, cand, id)?.verdict(reference, id, cand) {
                    return Ok(Some(f));
                }
            }
        }
    }
    Ok(None)
}
