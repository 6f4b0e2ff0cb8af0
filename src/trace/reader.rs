//! Opens a trace: the manifest is read and checked at once, tensors only when asked for.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::weights::quant::dequantize;
use crate::weights::safetensors::SafetensorsSet;
use crate::weights::{Encoding, GgmlType, TensorEntry};

use super::error::{Result, TraceError};
use super::manifest::{Manifest, StageRecord, MANIFEST_NAME};
use super::stats::TensorStats;

/// A trace folder opened for reading.
#[derive(Debug)]
pub struct Trace {
    dir: PathBuf,
    manifest: Manifest,
    /// The scratch folder `dir` lies in, for a trace made from another tool's files (an SGLang
    /// dump): removed when the trace is dropped.
    scratch: Option<tempfile::TempDir>,
    /// The files it was made from, for a trace made from another tool's files.
    origin: Option<PathBuf>,
    /// Stages cut to another trace's token positions ([`Trace::at_rows_of`]), held here.
    cut: HashMap<String, Vec<f32>>,
}

impl Trace {
    /// Read and check `dir/manifest.json`.
    pub fn open(dir: &Path) -> Result<Trace> {
        let path = dir.join(MANIFEST_NAME);
        let text = std::fs::read(&path).map_err(|e| TraceError::io(&path, e))?;
        let manifest = Manifest::parse(dir, &text)?;
        Ok(Trace {
            dir: dir.to_path_buf(),
            manifest,
            scratch: None,
            origin: None,
            cut: HashMap::new(),
        })
    }

    /// This trace, made from the files at `origin` and written into `scratch`, which it owns.
    pub(crate) fn made_from(mut self, origin: &Path, scratch: tempfile::TempDir) -> Trace {
        self.scratch = Some(scratch);
        self.origin = Some(origin.to_path_buf());
        self
    }

    /// The path to name the trace by: its folder, or the files it was made from.
    pub fn shown(&self) -> &Path {
        self.origin.as_deref().unwrap_or(&self.dir)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Every record, in execution order.
    pub fn stages(&self) -> &[StageRecord] {
        &self.manifest.stages
    }

    /// The distinct stage names in execution order (per-rank records share one name).
    pub fn stage_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = Vec::new();
        for s in &self.manifest.stages {
            if !names.contains(&s.name.as_str()) {
                names.push(&s.name);
            }
        }
        names
    }

    /// The record of stage `name`, whole (`rank` None) or one rank's part.
    pub fn stage(&self, name: &str, rank: Option<u32>) -> Option<&StageRecord> {
        self.manifest
            .stages
            .iter()
            .find(|s| s.name == name && s.rank == rank)
    }

    /// The stage's values as f32 (i32 and f64 stages converted), or None when only its stats were
    /// recorded. A stage the trace does not hold is an error.
    pub fn tensor(&self, name: &str, rank: Option<u32>) -> Result<Option<Vec<f32>>> {
        if let (Some(values), None) = (self.cut.get(name), rank) {
            return Ok(Some(values.clone()));
        }
        self.read(name, rank, |set, t| match &t.encoding {
            Encoding::Ggml(GgmlType::I32) => Ok(i32s(set.bytes(t)).map(|v| v as f32).collect()),
            // An f64 reference run, narrowed: comparisons work at f32 resolution.
            Encoding::Ggml(GgmlType::F64) => Ok(set
                .bytes(t)
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8-byte chunk")) as f32)
                .collect()),
            Encoding::Ggml(ty) => {
                let mut out = vec![0f32; t.numel() as usize];
                dequantize(*ty, set.bytes(t), &mut out).map_err(|e| e.to_string())?;
                Ok(out)
            }
            other => Err(format!("stored as {other}, not a number")),
        })
    }

    /// This trace seen at the token positions `other` holds of its stages: a whole record of
    /// `other` with `rows` (the positions an engine computed, such as SGLang's logits of the
    /// prompt's last token) stands for those rows of this trace's stage, which are cut out and
    /// held in memory. None where `other` records every stage at every position.
    pub fn at_rows_of(&self, other: &Trace) -> Result<Option<Trace>> {
        let mut cut = HashMap::new();
        let mut manifest = self.manifest.clone();
        for theirs in other.stages().iter().filter(|s| s.rank.is_none()) {
            let Some(rows) = theirs.extra.get("rows").and_then(Value::as_array) else {
                continue;
            };
            let Some(mine) = manifest
                .stages
                .iter_mut()
                .find(|s| s.name == theirs.name && s.rank.is_none())
                .filter(|s| !self.cut.contains_key(&s.name))
            else {
                continue;
            };
            let bad = |why: String| {
                TraceError::field(other.dir(), format!("stage \"{}\" rows", theirs.name), why)
            };
            let Some(values) = self.tensor(&mine.name, None)? else {
                return Err(bad(format!(
                    "{} keeps only its statistics",
                    self.dir.display()
                )));
            };
            let n = mine.shape.first().copied().unwrap_or(0).max(1);
            let width = values.len() / n as usize;
            let mut kept = Vec::with_capacity(rows.len() * width);
            for row in rows {
                match row.as_u64().filter(|&r| r < n) {
                    Some(r) => kept.extend_from_slice(&values[r as usize * width..][..width]),
                    None => return Err(bad(format!("{row} is not a row of {n}"))),
                }
            }
            mine.shape[0] = rows.len() as u64;
            mine.stats = TensorStats::of(&kept);
            (mine.file, mine.tensor) = (None, None);
            cut.insert(mine.name.clone(), kept);
        }
        if cut.is_empty() {
            return Ok(None);
        }
        Ok(Some(Trace {
            dir: self.dir.clone(),
            manifest,
            scratch: None,
            origin: self.origin.clone(),
            cut,
        }))
    }

    /// The values of an i32 stage (top-k ids, positions), or None when only its stats were
    /// recorded.
    pub fn tensor_i32(&self, name: &str, rank: Option<u32>) -> Result<Option<Vec<i32>>> {
        self.read(name, rank, |set, t| match &t.encoding {
            Encoding::Ggml(GgmlType::I32) => Ok(i32s(set.bytes(t)).collect()),
            other => Err(format!("stored as {other}, not I32")),
        })
    }

    /// Find the stage's tensor in its file, check its shape against the manifest, and `decode`
    /// it (its error is the reason the values cannot be used).
    fn read<T>(
        &self,
        name: &str,
        rank: Option<u32>,
        decode: impl FnOnce(&SafetensorsSet, &TensorEntry) -> Result<Vec<T>, String>,
    ) -> Result<Option<Vec<T>>> {
        let mut stages = self.manifest.stages.iter().enumerate();
        let Some((index, record)) = stages.find(|(_, s)| s.name == name && s.rank == rank) else {
            let field = match rank {
                Some(r) => format!("stage \"{name}\" rank {r}"),
                None => format!("stage \"{name}\""),
            };
            return Err(TraceError::field(&self.dir, field, "not in the trace"));
        };
        let (Some(file), Some(tensor)) = (&record.file, &record.tensor) else {
            return Ok(None);
        };
        let bad = |field: &str, reason: String| {
            TraceError::field(
                &self.dir,
                format!("{} {field}", record.label(index)),
                reason,
            )
        };
        let set = SafetensorsSet::open(&self.dir.join(file))?;
        let Some(t) = set.get(tensor) else {
            return Err(bad("tensor", format!("`{tensor}` is not in {file}")));
        };
        if t.shape != record.shape {
            let why = format!(
                "{file} holds {:?}, the manifest says {:?}",
                t.shape, record.shape
            );
            return Err(bad("shape", why));
        }
        decode(&set, t).map(Some).map_err(|why| bad("tensor", why))
    }
}

/// Little-endian i32s of `bytes` (a whole number of them: the safetensors header was checked).
fn i32s(bytes: &[u8]) -> impl Iterator<Item = i32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}
