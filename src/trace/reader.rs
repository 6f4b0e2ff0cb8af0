//! Opens a trace: the manifest is read and checked at once, tensors only when asked for.

use std::path::{Path, PathBuf};

use crate::weights::quant::dequantize;
use crate::weights::safetensors::SafetensorsSet;
use crate::weights::{Encoding, GgmlType, TensorEntry};

use super::error::{Result, TraceError};
use super::manifest::{Manifest, StageRecord, MANIFEST_NAME};

/// A trace folder opened for reading.
#[derive(Debug)]
pub struct Trace {
    dir: PathBuf,
    manifest: Manifest,
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
        })
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
