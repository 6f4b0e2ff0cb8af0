//! Which tensors a synthetic checkpoint holds in a given layout, and how each one's rows come
//! from the canonical weights (HF names, whole `kv_b_proj`, stacked experts).

use std::ops::Range;

use crate::model::kv_b::{split_kv_b, KvBDims};
use crate::model::names::{LayerWeight, WeightId};
use crate::model::schema::{expected, Expected, ExpertForm, Family, KvBForm, Layout};
use crate::model::Glm5Config;

use super::weights::WeightGen;

/// Where a stored tensor's values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A canonical weight as it is.
    Canonical(WeightId),
    /// llama.cpp's `attn_k_b` / `attn_v_b` split of layer `l`'s `kv_b_proj`.
    KB(u64),
    VB(u64),
    /// One expert of a stacked canonical expert weight.
    Expert {
        layer: u64,
        expert: u64,
        which: LayerWeight,
    },
    /// transformers' packed `[E, 2I, H]`: per expert, gate rows then up rows.
    FusedGateUp(u64),
}

/// One tensor of the output file.
#[derive(Clone, Debug)]
pub struct Planned {
    pub name: String,
    /// Row-major shape as stored.
    pub shape: Vec<u64>,
    pub source: Source,
}

impl Planned {
    pub fn row_len(&self) -> u64 {
        *self.shape.last().unwrap_or(&1)
    }
    pub fn rows(&self) -> u64 {
        self.shape.iter().product::<u64>() / self.row_len().max(1)
    }
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Every tensor of a checkpoint of `cfg` in `layout`, in schema order. Optional tensors are left
/// out, except GGUF's `output.weight` (GLM-5's lm_head is untied).
pub fn plan(cfg: &Glm5Config, layout: Layout) -> Vec<Planned> {
    expected(cfg, layout)
        .into_iter()
        .filter(|e| !e.optional || e.id == WeightId::LmHead)
        .map(|e| Planned {
            source: source_of(&e),
            name: e.name,
            shape: e.shape,
        })
        .collect()
}

fn source_of(e: &Expected) -> Source {
    match e.id {
        WeightId::Layer(l, LayerWeight::KB) => Source::KB(l),
        WeightId::Layer(l, LayerWeight::VB) => Source::VB(l),
        WeightId::Layer(l, LayerWeight::ExpertsGateUp) => Source::FusedGateUp(l),
        WeightId::Expert {
            layer,
            expert,
            which,
        } => Source::Expert {
            layer,
            expert,
            which,
        },
        id => Source::Canonical(id),
    }
}

/// The layout canonical weights are generated in.
pub const CANONICAL: Layout = Layout {
    family: Family::Hf,
    kv_b: KvBForm::Whole,
    experts: ExpertForm::Stacked,
};

/// Shape of a canonical weight.
fn canonical_shape(cfg: &Glm5Config, id: WeightId) -> Vec<u64> {
    expected(cfg, CANONICAL)
        .into_iter()
        .find(|e| e.id == id)
        .map(|e| e.shape)
        .unwrap_or_else(|| panic!("{id} is not a canonical weight"))
}

/// Rows `rows` of planned tensor `p`, flattened.
pub fn rows(gen: &WeightGen, cfg: &Glm5Config, p: &Planned, rows: Range<u64>) -> Vec<f32> {
    let row_len = p.row_len() as usize;
    let slice =
        |v: Vec<f32>| v[rows.start as usize * row_len..rows.end as usize * row_len].to_vec();
    match p.source {
        Source::Canonical(id) => gen.rows(id, &p.shape, rows),
        Source::KB(l) | Source::VB(l) => {
            let id = WeightId::Layer(l, LayerWeight::KvB);
            let shape = canonical_shape(cfg, id);
            let kv_b = gen.rows(id, &shape, 0..shape[0]);
            let dims = KvBDims {
                heads: cfg.num_attention_heads as usize,
                kv_lora: cfg.kv_lora_rank as usize,
                nope: cfg.qk_nope_head_dim as usize,
                v: cfg.v_head_dim as usize,
            };
            let (k_b, v_b) =
                split_kv_b(&kv_b, dims).expect("the schema's kv_b shape matches its dims");
            slice(if matches!(p.source, Source::KB(_)) {
                k_b
            } else {
                v_b
            })
        }
        Source::Expert {
            layer,
            expert,
            which,
        } => {
            let id = WeightId::Layer(layer, which);
            let out = p.shape[0];
            gen.rows(
                id,
                &canonical_shape(cfg, id),
                expert * out + rows.start..expert * out + rows.end,
            )
        }
        Source::FusedGateUp(l) => {
            // Row r of the packed tensor: expert r / 2I, then gate (first I rows) or up.
            let inter = cfg.moe_intermediate_size;
            let (gate, up) = (
                WeightId::Layer(l, LayerWeight::ExpertsGate),
                WeightId::Layer(l, LayerWeight::ExpertsUp),
            );
            let shape = canonical_shape(cfg, gate);
            rows.flat_map(|r| {
                let (e, i) = (r / (2 * inter), r % (2 * inter));
                let (id, i) = if i < inter {
                    (gate, i)
                } else {
                    (up, i - inter)
                };
                gen.rows(id, &shape, e * inter + i..e * inter + i + 1)
            })
            .collect()
        }
    }
}
