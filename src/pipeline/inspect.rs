//! `glmcheck inspect`: what a checkpoint holds, which member of the family it is, and whether
//! it is complete.

use std::collections::BTreeMap;

use anyhow::Result;

use super::model::glm5_config;
use crate::model::names::WeightId;
use crate::model::schema::{self, Family};
use crate::model::switches;
use crate::report::inspect::{
    FamilyView, InspectReport, QuantType, RankBytes, SchemaCheck, Tensor,
};
use crate::shard::bytes_per_rank;
use crate::weights::ModelFiles;

/// Tensor-parallel sizes whose per-rank bytes are reported.
const TP_SIZES: [u64; 4] = [1, 2, 4, 8];

/// Arrays in the metadata's JSON longer than this are cut to their first items.
const JSON_ITEMS: usize = 16;

/// Per storage type in name order: tensors, elements, bytes.
fn quant_types(files: &ModelFiles) -> Vec<QuantType> {
    let mut h: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for t in files.tensors() {
        let e = h.entry(t.encoding.name().to_string()).or_default();
        *e = (e.0 + 1, e.1 + t.numel(), e.2 + t.nbytes);
    }
    h.into_iter()
        .map(|(ty, (tensors, elements, bytes))| QuantType {
            bytes,
            elements,
            tensors,
            ty,
        })
        .collect()
}

/// The bytes per rank at each of [`TP_SIZES`].
fn rank_bytes(files: &ModelFiles, family: Family) -> Vec<RankBytes> {
    let roles: Vec<(Option<WeightId>, u64)> = files
        .tensors()
        .iter()
        .map(|t| (schema::role(family, &t.name), t.nbytes))
        .collect();
    TP_SIZES
        .iter()
        .map(|&tp| RankBytes {
            bytes: bytes_per_rank(&roles, tp),
            tp,
        })
        .collect()
}

/// The report of an opened checkpoint: its GLM-5 config and schema check where it is one.
pub fn inspect(files: &ModelFiles) -> Result<InspectReport> {
    let config = glm5_config(files)?;
    let family = config
        .as_ref()
        .map(|c| c.1)
        .unwrap_or(if files.gguf().is_some() {
            Family::Gguf
        } else {
            Family::Hf
        });
    let schema = config.as_ref().map(|(cfg, fam)| {
        let report = schema::check(cfg, *fam, files.tensors());
        SchemaCheck {
            ok: report.ok(),
            report,
        }
    });
    let metadata = files.gguf().map(|g| g.metadata());
    Ok(InspectReport {
        architecture: files
            .gguf()
            .and_then(|g| g.architecture())
            .map(str::to_string),
        bytes_per_rank: rank_bytes(files, family),
        family: config.as_ref().map(|(c, _)| FamilyView {
            member: c.member.model_type().into(),
            name: c.member.name().into(),
            differences: switches::differences(c),
        }),
        config: config.map(|c| c.0),
        files: files.files(),
        format: files.format(),
        metadata: metadata
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.to_json(JSON_ITEMS)))
            .collect(),
        path: files.path.clone(),
        quant_types: quant_types(files),
        schema,
        tensors: files
            .tensors()
            .iter()
            .map(|t| Tensor {
                bytes: t.nbytes,
                file: t.file,
                name: t.name.clone(),
                shape: t.shape.clone(),
                ty: t.encoding.name().to_string(),
            })
            .collect(),
        metadata_text: metadata
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.to_string())).collect()),
    })
}
