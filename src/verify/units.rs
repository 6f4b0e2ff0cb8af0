//! What each stored tensor of a candidate checkpoint should hold, in the candidate's own layout.
//!
//! A candidate tensor is cut into units — one expert of a stacked expert tensor, a block of rows
//! of anything else — and each unit knows how to get the reference's values for exactly its
//! rows: through the name map, llama.cpp's split of `kv_b_proj`, stacked, per-expert or fused
//! experts. Quantization works row by row, so the reference's values must be laid out as the
//! candidate stores them for a re-quantization to be comparable byte for byte. One unit is in
//! memory at a time.

use std::ops::Range;

use anyhow::{Context, Result};

use crate::exec::source::WeightSource;
use crate::model::kv_b::{split_kv_b, KvBDims};
use crate::model::names::{LayerWeight, WeightId};
use crate::model::schema::role;
use crate::weights::{Encoding, TensorEntry};

/// Values of a unit made of plain rows at most (16 MiB of f32).
const UNIT_VALUES: u64 = 1 << 22;

/// Where a unit's reference values come from.
#[derive(Clone, Copy, Debug)]
enum Reference {
    /// The same rows of the reference's tensor of this role.
    Rows(WeightId),
    /// A vector weight (norm, bias), whole.
    Vector(WeightId),
    /// Routed expert `expert`'s `which` matrix.
    Expert {
        layer: u64,
        expert: u64,
        which: LayerWeight,
    },
    /// Routed expert `expert`'s gate rows, then its up rows (a fused `gate_up` tensor).
    ExpertGateUp { layer: u64, expert: u64 },
    /// `kv_b_proj` of a layer, whole (the reference may store it split).
    KvB(u64),
    /// llama.cpp's `attn_k_b` or `attn_v_b` cut from the reference's `kv_b_proj`.
    KvBPart { layer: u64, k: bool },
}

/// One unit: rows of the candidate tensor and where the reference's values for them are.
#[derive(Clone, Debug)]
pub struct Unit {
    pub rows: Range<u64>,
    /// The routed expert this unit is, in a stacked expert tensor.
    pub expert: Option<u64>,
    reference: Reference,
}

/// A candidate tensor planned for checking.
pub struct Plan<'a> {
    pub tensor: &'a TensorEntry,
    pub id: WeightId,
    pub units: Vec<Unit>,
    /// Rows per attention head where the tensor's rows are grouped by head (for a head map).
    pub head_rows: Option<u64>,
}

/// Why a candidate tensor is not checked.
pub enum Skip {
    /// Not a GLM-5 weight glmcheck knows (or a scale tensor that belongs to its weight).
    NoRole,
    /// The reference has no counterpart.
    NotInReference(String),
    /// Stored in an encoding without an f32 form.
    NoValues,
}

impl Skip {
    pub fn why(&self) -> String {
        match self {
            Skip::NoRole => "no GLM-5 role".into(),
            Skip::NotInReference(what) => format!("the reference has no {what}"),
            Skip::NoValues => "stored in an encoding with no f32 form".into(),
        }
    }
}

/// The units of `t`, a tensor of the candidate `cand`, against the reference `reference`.
pub fn plan<'a>(
    reference: &WeightSource,
    cand: &'a WeightSource,
    t: &'a TensorEntry,
) -> std::result::Result<Plan<'a>, Skip> {
    if t.name.ends_with("_scale_inv") {
        return Err(Skip::NoRole);
    }
    if !cand.files.can_dequantize(t) || matches!(t.encoding, Encoding::Other(_)) {
        return Err(Skip::NoValues);
    }
    let family = cand.layout().family;
    let id = role(family, &t.name).ok_or(Skip::NoRole)?;
    let cfg = &reference.cfg;
    let heads = cfg.num_attention_heads;
    let whole = |r: Reference| vec![unit(0..t.rows(), None, r)];
    let (units, head_rows) = match id {
        WeightId::Layer(
            l,
            w @ (LayerWeight::ExpertsGate | LayerWeight::ExpertsUp | LayerWeight::ExpertsDown),
        ) => (
            per_expert(t, |e| Reference::Expert {
                layer: l,
                expert: e,
                which: w,
            }),
            None,
        ),
        WeightId::Layer(l, LayerWeight::ExpertsGateUp) => (
            per_expert(t, |e| Reference::ExpertGateUp {
                layer: l,
                expert: e,
            }),
            None,
        ),
        WeightId::Expert {
            layer,
            expert,
            which,
        } => (
            whole(Reference::Expert {
                layer,
                expert,
                which,
            }),
            None,
        ),
        WeightId::Layer(l, LayerWeight::KB) => (
            whole(Reference::KvBPart { layer: l, k: true }),
            Some(cfg.kv_lora_rank),
        ),
        WeightId::Layer(l, LayerWeight::VB) => (
            whole(Reference::KvBPart { layer: l, k: false }),
            Some(cfg.v_head_dim),
        ),
        WeightId::Layer(l, LayerWeight::KvB) => (
            whole(Reference::KvB(l)),
            Some(cfg.qk_nope_head_dim + cfg.v_head_dim),
        ),
        _ if t.shape.len() <= 1 => {
            if !reference.has(id) {
                return Err(Skip::NotInReference(id.to_string()));
            }
            (whole(Reference::Vector(id)), None)
        }
        _ => {
            if !reference.has(id) {
                return Err(Skip::NotInReference(id.to_string()));
            }
            let per_head = match id {
                WeightId::Layer(_, LayerWeight::QB | LayerWeight::QProj) => {
                    Some(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
                }
                _ => None,
            };
            (row_blocks(t, Reference::Rows(id)), per_head)
        }
    };
    let head_rows = head_rows.filter(|&r| r > 0 && t.rows() == r * heads);
    Ok(Plan {
        tensor: t,
        id,
        units,
        head_rows,
    })
}

fn unit(rows: Range<u64>, expert: Option<u64>, reference: Reference) -> Unit {
    Unit {
        rows,
        expert,
        reference,
    }
}

/// One unit per expert of a stacked `[E, rows, cols]` tensor.
fn per_expert(t: &TensorEntry, reference: impl Fn(u64) -> Reference) -> Vec<Unit> {
    let (experts, rows) = match t.shape[..] {
        [e, r, _] => (e, r),
        _ => (1, t.rows()),
    };
    (0..experts)
        .map(|e| unit(e * rows..(e + 1) * rows, Some(e), reference(e)))
        .collect()
}

/// Blocks of whole rows, each at most [`UNIT_VALUES`] values.
fn row_blocks(t: &TensorEntry, reference: Reference) -> Vec<Unit> {
    let per = (UNIT_VALUES / t.row_len().max(1)).max(1);
    (0..t.rows())
        .step_by(per as usize)
        .map(|start| unit(start..(start + per).min(t.rows()), None, reference))
        .collect()
}

/// The candidate's values of `u`, dequantized from its stored bytes.
pub fn candidate_values(cand: &WeightSource, t: &TensorEntry, u: &Unit) -> Result<Vec<f32>> {
    let v = cand.files.dequantize_rows(t, u.rows.clone())?;
    cand.files.release_rows(t, u.rows.clone());
    Ok(v)
}

/// The stored bytes of `u`'s rows in the candidate's file.
pub fn candidate_bytes<'a>(cand: &'a WeightSource, t: &TensorEntry, u: &Unit) -> Option<&'a [u8]> {
    let Encoding::Ggml(ty) = t.encoding else {
        return None;
    };
    let row_bytes = ty.bytes_for(t.row_len())?;
    let bytes = cand.files.bytes(t);
    bytes.get((u.rows.start * row_bytes) as usize..(u.rows.end * row_bytes) as usize)
}

/// The reference's values for `u`, laid out as the candidate stores them.
pub fn reference_values(reference: &WeightSource, u: &Unit) -> Result<Vec<f32>> {
    let cfg = &reference.cfg;
    let values = match u.reference {
        Reference::Rows(id) => reference.matrix_rows(id, u.rows.clone())?.into_data(),
        Reference::Vector(id) => reference.vector(id)?,
        Reference::Expert {
            layer,
            expert,
            which,
        } => reference.expert_matrix(layer, expert, which)?.into_data(),
        Reference::ExpertGateUp { layer, expert } => {
            let mut gate = reference
                .expert_matrix(layer, expert, LayerWeight::ExpertsGate)?
                .into_data();
            gate.extend(
                reference
                    .expert_matrix(layer, expert, LayerWeight::ExpertsUp)?
                    .into_data(),
            );
            gate
        }
        Reference::KvB(l) => {
            let m = reference.matrix(WeightId::Layer(l, LayerWeight::KvB))?;
            let r = u.rows.start as usize * m.cols..u.rows.end as usize * m.cols;
            m.data().get(r).context("kv_b_proj rows")?.to_vec()
        }
        Reference::KvBPart { layer, k } => {
            let kv_b = reference.matrix(WeightId::Layer(layer, LayerWeight::KvB))?;
            let dims = KvBDims {
                heads: cfg.num_attention_heads as usize,
                kv_lora: cfg.kv_lora_rank as usize,
                nope: cfg.qk_nope_head_dim as usize,
                v: cfg.v_head_dim as usize,
            };
            let (k_b, v_b) = split_kv_b(kv_b.data(), dims)
                .with_context(|| format!("layer {layer} kv_b_proj"))?;
            if k {
                k_b
            } else {
                v_b
            }
        }
    };
    Ok(values)
}

/// The reference's and the candidate's values of `u` (as many, or an error naming both counts).
pub fn both(
    reference: &WeightSource,
    cand: &WeightSource,
    t: &TensorEntry,
    u: &Unit,
) -> Result<(Vec<f32>, Vec<f32>), Mismatch> {
    let r = reference_values(reference, u).map_err(Mismatch::Read)?;
    let c = candidate_values(cand, t, u).map_err(Mismatch::Read)?;
    if r.len() != c.len() {
        return Err(Mismatch::Count(format!(
            "{}: rows {:?} hold {} values, the reference's counterpart {}",
            t.name,
            u.rows,
            c.len(),
            r.len()
        )));
    }
    Ok((r, c))
}

/// Why [`both`] has no pair of values.
pub enum Mismatch {
    /// The two sides hold different numbers of values (a shape fault).
    Count(String),
    Read(anyhow::Error),
}

impl From<Mismatch> for anyhow::Error {
    fn from(m: Mismatch) -> Self {
        match m {
            Mismatch::Count(why) => anyhow::anyhow!(why),
            Mismatch::Read(e) => e,
        }
    }
}
