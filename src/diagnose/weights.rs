//! The divergent stage's weights as the candidate reads them against the reference's
//! dequantization of the same files: a permutation of rows is a layout fault, any other
//! difference a dequantization fault (the bytes are the same, so noise is no excuse); a weight
//! of zeros was never loaded.

use std::collections::HashMap;

use anyhow::Result;

use super::CandidateRun;
use crate::compare::metrics::Metrics;
use crate::compare::{Fault, FaultClass};
use crate::exec::mat::Mat;
use crate::exec::source::WeightSource;
use crate::model::names::{LayerWeight::*, WeightId};
use crate::weights::Encoding;

/// One weight on both sides, named for evidence.
struct Pair {
    label: String,
    reference: Mat,
    candidate: Mat,
}

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

/// `id` from both sides; routed experts as the candidate's chosen ones, one matrix at a time.
fn pairs(reference: &WeightSource, cand: &CandidateRun, id: WeightId) -> Result<Vec<Pair>> {
    let label = id.to_string();
    Ok(match id {
        WeightId::Layer(l, ExpertsGate) => {
            let mut out = Vec::new();
            for &e in &cand.experts {
                let (r, c) = (reference.expert(l, e)?, cand.src.expert(l, e)?);
                for ((which, r), c) in ["gate", "up", "down"].iter().zip(r).zip(c) {
                    out.push(Pair {
                        label: format!("layer {l} expert {e} {which}"),
                        reference: r,
                        candidate: c,
                    });
                }
            }
            out
        }
        // Covered with the gate.
        WeightId::Layer(_, ExpertsUp | ExpertsDown) => Vec::new(),
        id if is_vector(id) => {
            let (r, c) = (reference.vector(id)?, cand.src.vector(id)?);
            vec![Pair {
                label,
                reference: Mat::new(1, r.len(), r),
                candidate: Mat::new(1, c.len(), c),
            }]
        }
        id => vec![Pair {
            label,
            reference: reference.matrix(id)?,
            candidate: cand.src.matrix(id)?,
        }],
    })
}

/// The first weight among `ids` the candidate reads differently.
pub fn check_weights(
    reference: &WeightSource,
    cand: &CandidateRun,
    ids: &[WeightId],
) -> Result<Option<Fault>> {
    for &id in ids {
        for pair in pairs(reference, cand, id)? {
            if let Some(f) = compare(reference, id, &pair, cand.same_files) {
                return Ok(Some(f));
            }
        }
    }
    Ok(None)
}

/// For each candidate row, a reference row with the same values, when every row has one.
fn row_permutation(reference: &Mat, candidate: &Mat) -> Option<Vec<usize>> {
    let key = |row: &[f32]| row.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    let mut at: HashMap<Vec<u32>, Vec<usize>> = HashMap::new();
    for r in (0..reference.rows).rev() {
        at.entry(key(reference.row(r))).or_default().push(r);
    }
    (0..candidate.rows)
        .map(|r| at.get_mut(&key(candidate.row(r)))?.pop())
        .collect()
}

fn compare(reference: &WeightSource, id: WeightId, pair: &Pair, same_files: bool) -> Option<Fault> {
    let Pair {
        label,
        reference: r,
        candidate: c,
    } = pair;
    if (r.rows, r.cols) != (c.rows, c.cols) {
        return Some(Fault {
            class: FaultClass::WeightLayout,
            summary: format!("{label} has another shape in the candidate"),
            evidence: vec![format!(
                "{label}: [{}, {}] in the candidate, [{}, {}] in the reference",
                c.rows, c.cols, r.rows, r.cols
            )],
            weight: Some(label.clone()),
        });
    }
    if r.data
        .iter()
        .zip(&c.data)
        .all(|(a, b)| a.to_bits() == b.to_bits())
    {
        return None;
    }
    if let Some(perm) = row_permutation(r, c) {
        let moved: Vec<String> = perm
            .iter()
            .enumerate()
            .filter(|(i, p)| i != *p)
            .take(4)
            .map(|(i, p)| format!("row {i} is the reference's row {p}"))
            .collect();
        let count = perm.iter().enumerate().filter(|(i, p)| i != *p).count();
        return Some(Fault {
            class: FaultClass::WeightLayout,
            summary: format!("{label}: the reference's rows in another order"),
            evidence: vec![format!(
                "{label}: {count} of {} rows moved ({}, …); every value is the reference's",
                r.rows,
                moved.join(", ")
            )],
            weight: Some(label.clone()),
        });
    }
    if !same_files {
        return None;
    }
    if c.data.iter().all(|v| *v == 0.0) {
        return Some(Fault {
            class: FaultClass::Unknown,
            summary: format!("{label} is all zeros in the candidate: never loaded"),
            evidence: vec![format!(
                "{label}: every one of {} values is 0 in the candidate; the reference's absmax is \
                 {:e}",
                c.data.len(),
                r.data.iter().fold(0f32, |m, v| m.max(v.abs()))
            )],
            weight: Some(label.clone()),
        });
    }
    let m = Metrics::of(&r.data, &c.data);
    let first = r
        .data
        .iter()
        .zip(&c.data)
        .position(|(a, b)| a.to_bits() != b.to_bits())
        .unwrap_or(0);
    let names = reference.tensor_names(id);
    let stored = names
        .first()
        .and_then(|n| reference.files.get(n))
        .map(|t| match &t.encoding {
            Encoding::Ggml(ty) => (ty.name().to_string(), ty.block_size()),
            other => (format!("{other:?}"), 1),
        });
    let (ty, block) = stored.unwrap_or_else(|| ("?".into(), 1));
    let (row, col) = (first / r.cols.max(1), first % r.cols.max(1));
    let differing = r
        .data
        .iter()
        .zip(&c.data)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    Some(Fault {
        class: FaultClass::WrongDequant,
        summary: format!(
            "{label} ({ty}): the candidate's dequantization of the same bytes differs from the \
             reference's"
        ),
        evidence: vec![
            format!(
                "{} ({ty}): rel_diff {:.3e}, max |Δ| {:.3e}, {differing} of {} values differ",
                names.join(" + "),
                m.rel_diff,
                m.max_abs,
                r.data.len()
            ),
            format!(
                "first difference at row {row}, column {col}: block {} of the row (elements \
                 {}..{}), position {} in it",
                col / block,
                col / block * block,
                col / block * block + block,
                col % block
            ),
        ],
        weight: Some(label.clone()),
    })
}
