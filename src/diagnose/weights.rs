//! The divergent stage's weights as the candidate reads them against the reference's.
//!
//! The reference's values moved (rows reordered, or transposed within rows) are a layout fault;
//! a weight of zeros was never loaded. Otherwise, from the same files any difference is the
//! candidate's dequantization (the bytes are the same, so noise is no excuse); from a
//! conversion, a difference beyond what storing the reference's values in the candidate's
//! type leaves of them.

use std::collections::HashMap;

use anyhow::Result;

use super::CandidateRun;
use crate::compare::metrics::Metrics;
use crate::compare::{Fault, FaultClass};
use crate::exec::mat::Mat;
use crate::exec::source::WeightSource;
use crate::model::names::{LayerWeight::*, WeightId};
use crate::synth::quantize::round_trip;
use crate::weights::{Encoding, GgmlType};

/// How far past its storage type's own noise a converted weight may depart.
const NOISE_FACTOR: f64 = 10.0;

/// One weight on both sides, named for evidence, with the type the candidate stores it as.
struct Pair {
    label: String,
    reference: Mat,
    candidate: Mat,
    stored: Option<GgmlType>,
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
    let stored = cand.src.storage_type(id);
    Ok(match id {
        WeightId::Layer(l, ExpertsGate) => {
            let mut out = Vec::new();
            for &e in &cand.experts {
                let (r, c) = (reference.expert(l, e)?, cand.src.expert(l, e)?);
                let roles = [
                    ("gate", ExpertsGate),
                    ("up", ExpertsUp),
                    ("down", ExpertsDown),
                ];
                for (((which, role), r), c) in roles.into_iter().zip(r).zip(c) {
                    out.push(Pair {
                        label: format!("layer {l} expert {e} {which}"),
                        reference: r,
                        candidate: c,
                        stored: cand.src.storage_type(WeightId::Layer(l, role)),
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
                stored,
            }]
        }
        id => vec![Pair {
            label,
            reference: reference.matrix(id)?,
            candidate: cand.src.matrix(id)?,
            stored,
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
            if let Some(f) = compare(reference, id, &pair, cand.same_files)? {
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

fn fault(class: FaultClass, label: &str, summary: String, evidence: Vec<String>) -> Fault {
    Fault {
        class,
        summary,
        evidence,
        weight: Some(label.to_string()),
    }
}

/// The reference's values moved: other shape, rows reordered, or rearranged within rows.
fn moved(label: &str, r: &Mat, c: &Mat) -> Option<Fault> {
    let layout = |summary: String, evidence: String| {
        Some(fault(
            FaultClass::WeightLayout,
            label,
            summary,
            vec![evidence],
        ))
    };
    if (r.rows, r.cols) != (c.rows, c.cols) {
        return layout(
            format!("{label} has another shape in the candidate"),
            format!(
                "{label}: [{}, {}] in the candidate, [{}, {}] in the reference",
                c.rows, c.cols, r.rows, r.cols
            ),
        );
    }
    if let Some(perm) = row_permutation(r, c) {
        let moved: Vec<(usize, &usize)> =
            perm.iter().enumerate().filter(|(i, p)| i != *p).collect();
        let shown: Vec<String> = moved
            .iter()
            .take(4)
            .map(|(i, p)| format!("row {i} is the reference's row {p}"))
            .collect();
        return layout(
            format!("{label}: the reference's rows in another order"),
            format!(
                "{label}: {} of {} rows moved ({}, …); every value is the reference's",
                moved.len(),
                r.rows,
                shown.join(", ")
            ),
        );
    }
    let sorted = |m: &Mat| {
        let mut v = m.data.clone();
        v.sort_by(f32::total_cmp);
        v
    };
    if sorted(r) == sorted(c) {
        return layout(
            format!("{label}: the reference's values in another arrangement"),
            format!(
                "{label}: the same {} values, not row for row: transposed or interleaved within \
                 rows (per-head blocks of kv_b, attn_k_b's transpose)",
                r.data.len()
            ),
        );
    }
    None
}

fn compare(
    reference: &WeightSource,
    id: WeightId,
    pair: &Pair,
    same_files: bool,
) -> Result<Option<Fault>> {
    let (label, r, c) = (&pair.label, &pair.reference, &pair.candidate);
    let same_bits = |a: &f32, b: &f32| a.to_bits() == b.to_bits();
    if r.data.len() == c.data.len() && r.data.iter().zip(&c.data).all(|(a, b)| same_bits(a, b)) {
        return Ok(None);
    }
    if let Some(f) = moved(label, r, c) {
        return Ok(Some(f));
    }
    if c.data.iter().all(|v| *v == 0.0) {
        return Ok(Some(fault(
            FaultClass::Unknown,
            label,
            format!("{label} is all zeros in the candidate: never loaded"),
            vec![format!(
                "{label}: every one of {} values is 0 in the candidate; the reference's absmax \
                 is {:e}",
                c.data.len(),
                r.data.iter().fold(0f32, |m, v| m.max(v.abs()))
            )],
        )));
    }
    let m = Metrics::of(&r.data, &c.data);
    if !same_files {
        // A conversion: the candidate storage type's quantization noise is expected.
        let ty = pair.stored.unwrap_or(GgmlType::F32);
        let noise = Metrics::of(&r.data, &round_trip(ty, r.data.clone(), r.cols)?).rel_diff;
        if m.rel_diff <= NOISE_FACTOR * noise {
            return Ok(None);
        }
        return Ok(Some(fault(
            FaultClass::WrongDequant,
            label,
            format!(
                "{label} ({}): the candidate's values depart from the reference's beyond that \
                 type's quantization noise",
                ty.name()
            ),
            vec![format!(
                "{label}: rel_diff {:.3e} against the reference; storing the reference's \
                 values as {} departs {noise:.3e}",
                m.rel_diff,
                ty.name()
            )],
        )));
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
    let first = r
        .data
        .iter()
        .zip(&c.data)
        .position(|(a, b)| !same_bits(a, b))
        .unwrap_or(0);
    let differing = r
        .data
        .iter()
        .zip(&c.data)
        .filter(|(a, b)| !same_bits(a, b))
        .count();
    let (row, col) = (first / r.cols.max(1), first % r.cols.max(1));
    let start = col / block * block;
    Ok(Some(fault(
        FaultClass::WrongDequant,
        label,
        format!(
            "{label} ({ty}): the candidate's dequantization of the same bytes differs from the \
             reference's"
        ),
        vec![
            format!(
                "{} ({ty}): rel_diff {:.3e}, max |Δ| {:.3e}, {differing} of {} values differ",
                names.join(" + "),
                m.rel_diff,
                m.max_abs,
                r.data.len()
            ),
            format!(
                "first difference at row {row}, column {col}: block {} of the row (elements \
                 {start}..{}), position {} in it",
                col / block,
                start + block,
                col - start
            ),
        ],
    )))
}
