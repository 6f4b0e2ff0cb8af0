//! llama.cpp's split `kv_b_proj` judged as a loader re-assembles it.
//!
//! A converter that splits `kv_b_proj` wrongly (K and V rows taken in the wrong order) leaves
//! `attn_k_b` and `attn_v_b` each holding values of the other: neither tensor alone is the
//! reference's in any order, but re-assembled they are `kv_b_proj` with its rows moved. Where
//! both parts of a layer depart without a relation, this check re-assembles both sides and
//! looks for that row map.

use anyhow::Result;

use super::relation::moved::moved_rows;
use super::relation::{class_of, Finding, Relation};
use crate::exec::source::WeightSource;
use crate::model::names::{LayerWeight, WeightId};
use crate::model::schema::role;
use crate::weights::Encoding;

/// Replace unexplained findings on a layer's `attn_k_b`/`attn_v_b` by one row map of the
/// re-assembled `kv_b_proj`, where there is one.
pub fn regroup(
    reference: &WeightSource,
    cand: &WeightSource,
    findings: &mut Vec<Finding>,
) -> Result<()> {
    let family = cand.layout().family;
    let split_layer = |f: &Finding| match role(family, &f.tensor) {
        Some(WeightId::Layer(l, LayerWeight::KB | LayerWeight::VB))
            if f.relation == Relation::GarbageBlocks =>
        {
            Some(l)
        }
        _ => None,
    };
    let mut layers: Vec<u64> = findings.iter().filter_map(split_layer).collect();
    layers.dedup();
    for l in layers {
        let id = WeightId::Layer(l, LayerWeight::KvB);
        let names = cand.tensor_names(id);
        let (x, c) = (reference.matrix(id)?, cand.matrix(id)?);
        let ty = names
            .last()
            .and_then(|n| cand.files.get(n))
            .and_then(|t| match t.encoding {
                Encoding::Ggml(ty) => Some(ty),
                _ => None,
            });
        let Some(moved) = moved_rows(ty, x.cols, x.data(), c.data())? else {
            continue;
        };
        if moved.is_empty() {
            continue;
        }
        let shown: Vec<String> = moved
            .iter()
            .take(4)
            .map(|(r, o)| format!("row {r} is the reference's row {o}"))
            .collect();
        let joined = names.join(" + ");
        let relation = Relation::RowPermutation;
        let merged = Finding {
            tensor: names[0].clone(),
            class: class_of(relation, id, true),
            relation,
            summary: format!(
                "{joined}: kv_b_proj re-assembled from them holds the reference's rows in another \
                 order (a wrong split)"
            ),
            evidence: vec![format!(
                "{joined} re-assembled: {} of {} rows of kv_b_proj moved ({}, …); every value is \
                 the reference's",
                moved.len(),
                x.rows,
                shown.join(", ")
            )],
            factor: None,
            map: moved.iter().map(|&(r, o)| (r as u64, o as u64)).collect(),
            with: None,
        };
        let at = findings
            .iter()
            .position(|f| split_layer(f) == Some(l))
            .unwrap_or(0);
        findings.retain(|f| split_layer(f) != Some(l));
        findings.insert(at.min(findings.len()), merged);
    }
    Ok(())
}
