//! `glmcheck inspect`: what a checkpoint holds and whether it is a complete GLM-5, as JSON or as
//! terminal listings and tables.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::PathBuf;

use serde::Serialize;

use super::sorted_keys;
use super::terminal::{bytes, shape, table};
use crate::model::config::IndexerKind;
use crate::model::schema::SchemaReport;
use crate::model::switches::Switch;
use crate::model::Glm5Config;

/// Terminal listings stop after this many tensors, metadata keys or schema findings unless
/// `--all` (schema findings always).
const LIST_LIMIT: usize = 40;

/// A checkpoint's files, metadata, GLM-5 config, tensors, schema check, storage types and bytes
/// per TP rank.
#[derive(Clone, Debug, Serialize)]
pub struct InspectReport {
    /// A GGUF's `general.architecture`.
    pub architecture: Option<String>,
    pub bytes_per_rank: Vec<RankBytes>,
    /// `None` when the checkpoint is no member of the family.
    #[serde(serialize_with = "sorted_keys")]
    pub config: Option<Glm5Config>,
    /// Which member it is and how it runs otherwise than GLM-5.
    pub family: Option<FamilyView>,
    pub files: Vec<PathBuf>,
    /// `GGUF v3, 2 files`, `safetensors, 1 file`.
    pub format: String,
    /// A GGUF's metadata, long arrays cut to their first 16 items (empty for safetensors).
    pub metadata: BTreeMap<String, serde_json::Value>,
    pub path: PathBuf,
    /// Per storage type, in the types' name order.
    pub quant_types: Vec<QuantType>,
    /// `None` when the checkpoint is no GLM-5.
    pub schema: Option<SchemaCheck>,
    pub tensors: Vec<Tensor>,
    /// A GGUF's metadata in the file's order, each value in its short form for people; `None`
    /// for safetensors.
    #[serde(skip)]
    pub metadata_text: Option<Vec<(String, String)>>,
}

/// The member of the MLA/MoE family a checkpoint is.
#[derive(Clone, Debug, Serialize)]
pub struct FamilyView {
    /// Its `model_type` (`deepseek_v3`, `kimi_k2`, …).
    pub member: String,
    /// `DeepSeek-V3`, `Kimi-K2`, …
    pub name: String,
    /// The switches of the forward it sets otherwise than GLM-5.
    pub differences: Vec<Switch>,
}

/// The bytes each rank holds at one tensor-parallel degree under vLLM's plan.
#[derive(Clone, Debug, Serialize)]
pub struct RankBytes {
    pub bytes: u64,
    pub tp: u64,
}

/// One storage type's share of the checkpoint.
#[derive(Clone, Debug, Serialize)]
pub struct QuantType {
    pub bytes: u64,
    pub elements: u64,
    pub tensors: u64,
    #[serde(rename = "type")]
    pub ty: String,
}

/// The tensors against the GLM-5 schema of the checkpoint's config.
#[derive(Clone, Debug, Serialize)]
pub struct SchemaCheck {
    pub ok: bool,
    #[serde(serialize_with = "sorted_keys")]
    pub report: SchemaReport,
}

/// One stored tensor.
#[derive(Clone, Debug, Serialize)]
pub struct Tensor {
    pub bytes: u64,
    /// Its file's index in [`InspectReport::files`].
    pub file: usize,
    pub name: String,
    pub shape: Vec<u64>,
    #[serde(rename = "type")]
    pub ty: String,
}

/// The listings and tables for people: metadata and tensors cut to their first 40 unless `all`.
pub fn text(r: &InspectReport, all: bool) -> String {
    let limit = if all { usize::MAX } else { LIST_LIMIT };
    let total: u64 = r.tensors.iter().map(|t| t.bytes).sum();
    let mut out = format!(
        "{}: {}, {} tensors, {}\n",
        r.path.display(),
        r.format,
        r.tensors.len(),
        bytes(total)
    );
    if let Some(metadata) = &r.metadata_text {
        let _ = writeln!(out, "\nmetadata ({} keys)", metadata.len());
        for (k, v) in metadata.iter().take(limit) {
            let _ = writeln!(out, "  {k} = {v}");
        }
        if !all && metadata.len() > LIST_LIMIT {
            let _ = writeln!(
                out,
                "  … {} more (--all lists them)",
                metadata.len() - LIST_LIMIT
            );
        }
    }
    match &r.config {
        Some(c) => {
            let _ = writeln!(out, "\n{} config ({})", c.member.name(), c.member.model_type());
            if let Some(f) = &r.family {
                for d in &f.differences {
                    let _ = writeln!(out, "  unlike GLM-5: {} = {} (GLM-5: {})", d.name, d.value, d.glm5);
                }
            }
            let v = serde_json::to_value(c).unwrap_or_default();
            for (k, val) in v.as_object().into_iter().flatten().filter(|(k, _)| *k != "indexer_types") {
                let _ = writeln!(out, "  {k} = {val}");
            }
            let shared = c.indexer_types.iter().filter(|k| **k == IndexerKind::Shared).count();
            let _ = writeln!(out, "  indexer layers = {} full, {shared} shared", c.indexer_types.len() - shared);
        }
        None => out.push_str("\nnot a checkpoint of the MLA/MoE family (GGUF glm-dsa/deepseek2/deepseek32, or a config.json model_type glmcheck runs): schema check skipped\n"),
    }
    let mut t = table(&["tensor", "type", "shape", "bytes"]);
    for e in r.tensors.iter().take(limit) {
        t.add_row(vec![
            e.name.clone(),
            e.ty.clone(),
            shape(&e.shape),
            bytes(e.bytes),
        ]);
    }
    let _ = writeln!(out, "\ntensors\n{t}");
    if !all && r.tensors.len() > LIST_LIMIT {
        let _ = writeln!(
            out,
            "… {} more (--all lists them)",
            r.tensors.len() - LIST_LIMIT
        );
    }
    if let Some(s) = &r.schema {
        schema_text(&mut out, &s.report);
    }
    let mut h = table(&["type", "tensors", "elements", "bytes", "share"]);
    for q in &r.quant_types {
        h.add_row(vec![
            q.ty.clone(),
            q.tensors.to_string(),
            q.elements.to_string(),
            bytes(q.bytes),
            format!("{:.1}%", 100.0 * q.bytes as f64 / total.max(1) as f64),
        ]);
    }
    let _ = writeln!(out, "\nstorage types\n{h}");
    let mut t = table(&["TP", "bytes per rank"]);
    for b in &r.bytes_per_rank {
        t.add_row(vec![b.tp.to_string(), bytes(b.bytes)]);
    }
    let _ = writeln!(out, "\nbytes per rank (vLLM's plan: attention heads, MLPs, experts, vocab sharded; the rest replicated)\n{t}");
    out
}

/// The schema check's verdict and its findings, each list cut to [`LIST_LIMIT`].
fn schema_text(out: &mut String, r: &SchemaReport) {
    let verdict = if r.ok() { "OK" } else { "FAILED" };
    let _ = writeln!(
        out,
        "\nschema check: {verdict} ({} expected, {} in file; kv_b {:?}, experts {:?}{})",
        r.expected,
        r.found,
        r.layout.kv_b,
        r.layout.experts,
        if r.mtp_layers.is_empty() {
            String::new()
        } else {
            format!(
                "; MTP layers {:?} recognised, left out of the forward",
                r.mtp_layers
            )
        }
    );
    let mut list = |title: &str, items: Vec<String>| {
        if !items.is_empty() {
            let _ = writeln!(out, "  {title} ({}):", items.len());
            for i in items.iter().take(LIST_LIMIT) {
                let _ = writeln!(out, "    {i}");
            }
            if items.len() > LIST_LIMIT {
                let _ = writeln!(out, "    … {} more", items.len() - LIST_LIMIT);
            }
        }
    };
    list("missing", r.missing.clone());
    list("unexpected", r.unexpected.clone());
    list(
        "wrong shape",
        r.wrong_shape
            .iter()
            .map(|w| format!("{}: expected {:?}, found {:?}", w.name, w.expected, w.found))
            .collect(),
    );
}
