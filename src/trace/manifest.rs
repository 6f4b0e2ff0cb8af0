//! `manifest.json`, the index of a trace (docs/design.md §5): the run's header and one record per
//! stage, with its statistics and, for full tensors, where the values are stored.
//!
//! Reading is strict about what tools rely on (format, version, names, shapes, file paths) and
//! lenient about the rest: fields this crate does not know, which engine probes may add, are
//! kept in `extra` and written back unchanged.

use std::collections::HashSet;
use std::path::{Component, Path};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::error::{Result, TraceError};
use super::stats::{TensorStats, SKETCH_BUCKETS};

/// The `format` of every trace manifest.
pub const FORMAT: &str = "glmcheck-trace";
/// The manifest version this crate reads and writes: 2 since stages' content hashes became lane
/// hashes (version 1's FNV-1a hashes can never equal them, so those traces are refused rather
/// than compared).
pub const VERSION: u64 = 2;
/// The manifest's file name inside the trace folder.
pub const MANIFEST_NAME: &str = "manifest.json";

/// The whole manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u64,
    /// Who wrote the trace (tool, version, command line): free-form.
    #[serde(default)]
    pub producer: Map<String, Value>,
    pub model: ModelInfo,
    /// The prompt's token ids.
    #[serde(default)]
    pub tokens: Vec<u32>,
    /// What computed the values: `glmcheck`, `vllm`, `llama.cpp`…
    pub backend: String,
    /// The compute dtype of the run (`bf16`, `f32`…).
    pub dtype: String,
    /// Tensor-parallel degree; ranks of per-rank stages are below it.
    pub tp: u32,
    /// Whether the run finished: a writer says `false` until its last group is written, so a
    /// run that was killed leaves a trace readers can open and know to be partial. Traces
    /// without the field (older ones, probes that write the manifest once) are complete.
    #[serde(default = "complete_by_default")]
    pub complete: bool,
    /// In execution order.
    #[serde(default)]
    pub stages: Vec<StageRecord>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn complete_by_default() -> bool {
    true
}

/// Which model the run used.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Path or hub id of the weights.
    pub source: String,
    /// The model config (its path, or the config object itself).
    #[serde(default)]
    pub config: Value,
    /// A digest of the weights, so traces of different weights are not compared unknowingly.
    #[serde(default)]
    pub fingerprint: String,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The element type of a stage's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ElemType {
    F32,
    /// A reference run at `--dtype f64`.
    F64,
    /// Ids and positions (top-k experts, DSA key positions).
    I32,
}

/// One recorded stage (docs/design.md §4 names), whole or one tensor-parallel rank's part.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageRecord {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: ElemType,
    /// The dims spec under TP (`t h(tp) d`).
    pub dims: String,
    /// The rank whose part this is; absent for the whole tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    pub stats: TensorStats,
    /// The safetensors file holding the values, relative to the trace folder; absent when only
    /// the stats are recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// The tensor's name in `file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<String>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl StageRecord {
    /// How errors name this stage: `stages[3] "L0.out"` (with the rank if it has one).
    pub fn label(&self, index: usize) -> String {
        match self.rank {
            Some(r) => format!("stages[{index}] \"{}\" rank {r}", self.name),
            None => format!("stages[{index}] \"{}\"", self.name),
        }
    }
}

impl Manifest {
    /// Parse and check the manifest of the trace at `dir`; errors name `dir` and the field.
    ///
    /// Format and version are checked before the rest is read, so a future version's other
    /// changes are reported as a version mismatch; stages are read one by one so that an error
    /// inside one names it.
    pub fn parse(dir: &Path, text: &[u8]) -> Result<Manifest> {
        let mut value: Value = serde_json::from_slice(text).map_err(|e| TraceError::Json {
            path: dir.join(MANIFEST_NAME),
            line: e.line(),
            column: e.column(),
            reason: e.to_string(),
        })?;
        let bad = |field: &str, reason: String| TraceError::field(dir, field, reason);
        let Some(top) = value.as_object_mut() else {
            return Err(bad("manifest", "not a JSON object".into()));
        };
        match top.get("format") {
            Some(Value::String(f)) if f == FORMAT => {}
            other => return Err(bad("format", format!("{other:?}, expected \"{FORMAT}\""))),
        }
        match top.get("version").and_then(Value::as_u64) {
            Some(VERSION) => {}
            _ => {
                let got = top.get("version").cloned().unwrap_or(Value::Null);
                let older = if got.as_u64().is_some_and(|v| v < VERSION) {
                    " (an older content hash: record the trace again with this glmcheck)"
                } else {
                    ""
                };
                return Err(bad(
                    "version",
                    format!("{got}, this glmcheck reads {VERSION}{older}"),
                ));
            }
        }
        let stages = match top.remove("stages") {
            None => Vec::new(),
            Some(Value::Array(stages)) => stages,
            Some(_) => return Err(bad("stages", "not an array".into())),
        };
        let mut manifest: Manifest =
            serde_json::from_value(value).map_err(|e| bad("manifest", e.to_string()))?;
        for (i, stage) in stages.into_iter().enumerate() {
            let record = serde_json::from_value(stage)
                .map_err(|e| bad(&format!("stages[{i}]"), e.to_string()))?;
            manifest.stages.push(record);
        }
        manifest.check(dir)?;
        Ok(manifest)
    }

    /// Pretty JSON with a final newline.
    pub fn to_json(&self) -> Vec<u8> {
        let mut text = serde_json::to_vec_pretty(self)
            .expect("a manifest has string keys only, so it always serializes");
        text.push(b'\n');
        text
    }

    /// The rules every reader relies on; each error names the stage and field.
    pub fn check(&self, dir: &Path) -> Result<()> {
        let mut seen = HashSet::new();
        for (i, s) in self.stages.iter().enumerate() {
            let bad = |field: &str, reason: String| {
                TraceError::field(dir, format!("{} {field}", s.label(i)), reason)
            };
            if s.name.is_empty() {
                return Err(TraceError::field(dir, format!("stages[{i}] name"), "empty"));
            }
            let numel = s.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
            if numel != Some(s.stats.count) {
                let why = format!(
                    "{:?} does not hold stats.count = {}",
                    s.shape, s.stats.count
                );
                return Err(bad("shape", why));
            }
            let buckets = s.stats.sketch.len();
            if buckets != 0 && buckets != SKETCH_BUCKETS {
                let why = format!("{buckets} buckets, not {SKETCH_BUCKETS}");
                return Err(bad("stats.sketch", why));
            }
            if let Some(r) = s.rank.filter(|&r| r >= self.tp) {
                return Err(bad("rank", format!("{r} is not below tp = {}", self.tp)));
            }
            match (&s.file, &s.tensor) {
                (None, None) => {}
                (Some(file), Some(_)) if !inside(file) => {
                    let why = format!("`{file}` is not a relative path inside the trace folder");
                    return Err(bad("file", why));
                }
                (Some(_), Some(_)) => {}
                (Some(_), None) => return Err(bad("tensor", "missing beside `file`".into())),
                (None, Some(_)) => return Err(bad("file", "missing beside `tensor`".into())),
            }
            if !seen.insert((s.name.as_str(), s.rank)) {
                return Err(bad("name", "recorded twice".into()));
            }
        }
        Ok(())
    }
}

/// Whether `file` names something below the trace folder: no `..`, no root, no drive prefix.
fn inside(file: &str) -> bool {
    !file.is_empty()
        && Path::new(file)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}
