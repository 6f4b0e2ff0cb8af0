//! GGUF models: one file, or a split set `NAME-0000k-of-0000n.gguf` opened as one model.

mod cursor;
mod file;
mod value;
pub mod writer;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

pub use file::GgufFile;
pub use value::{Value, ValueType};

use crate::weights::{Result, TensorEntry, WeightError};

/// gguf-split numbers shards with five digits; a larger count is hostile, and listing its
/// shard names would exhaust memory.
const MAX_SHARDS: u64 = 99_999;

/// A GGUF model: every shard of a split set, with one tensor list across them.
pub struct GgufModel {
    /// Shards in split order; the first holds the model's metadata.
    pub shards: Vec<GgufFile>,
    /// Every tensor of every shard; `file` indexes `shards`.
    pub tensors: Vec<TensorEntry>,
}

impl GgufModel {
    /// Open a GGUF file; a shard of a split set (any shard) opens the whole set.
    pub fn open(path: &Path) -> Result<Self> {
        let first = GgufFile::open(path)?;
        let count = split_key(&first, "split.count")?.unwrap_or(1);
        if count > MAX_SHARDS {
            return Err(WeightError::malformed(
                path,
                "metadata `split.count`",
                0,
                format!("{count} shards (at most {MAX_SHARDS})"),
            ));
        }
        if count <= 1 {
            let tensors = first.tensors.clone();
            return Ok(GgufModel {
                shards: vec![first],
                tensors,
            });
        }
        let paths = split_paths(path, count).ok_or_else(|| {
            WeightError::malformed(
                path,
                "metadata `split.count`",
                0,
                format!("says {count} shards, but the name is not NAME-0000k-of-{count:05}.gguf"),
            )
        })?;
        let mut shards = Vec::with_capacity(paths.len());
        for (no, p) in paths.iter().enumerate() {
            let shard = if *p == path {
                GgufFile::open(path)?
            } else {
                GgufFile::open(p)?
            };
            check_shard(&shard, no as u64, count)?;
            shards.push(shard);
        }
        let tensors = merge_tensors(&shards)?;
        Ok(GgufModel { shards, tensors })
    }

    /// Metadata of the model (the first shard's).
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.shards[0].metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.shards[0].get(key)
    }

    pub fn bytes(&self, t: &TensorEntry) -> &[u8] {
        self.shards[t.file].bytes(t)
    }

    /// The map of the shard holding `t`.
    pub fn map(&self, t: &TensorEntry) -> &std::sync::Arc<memmap2::Mmap> {
        self.shards[t.file].map()
    }

    pub fn paths(&self) -> Vec<PathBuf> {
        self.shards.iter().map(|s| s.path.clone()).collect()
    }

    /// `general.architecture`, if present.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }
}

fn split_key(f: &GgufFile, key: &str) -> Result<Option<u64>> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            WeightError::malformed(
                &f.path,
                format!("metadata `{key}`"),
                0,
                format!("{v} is not a count"),
            )
        }),
    }
}

/// The paths of all shards of the set `path` belongs to, by llama.cpp's naming.
fn split_paths(path: &Path, count: u64) -> Option<Vec<PathBuf>> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (prefix, tail) = stem.rsplit_once("-of-")?;
    let (prefix, _no) = prefix.rsplit_once('-')?;
    if tail.parse::<u64>().ok()? != count {
        return None;
    }
    Some(
        (1..=count)
            .map(|k| path.with_file_name(format!("{prefix}-{k:05}-of-{count:05}.gguf")))
            .collect(),
    )
}

fn check_shard(shard: &GgufFile, no: u64, count: u64) -> Result<()> {
    let got_no = split_key(shard, "split.no")?;
    let got_count = split_key(shard, "split.count")?;
    if got_no != Some(no) || got_count != Some(count) {
        return Err(WeightError::malformed(
            &shard.path,
            "metadata `split.no`/`split.count`",
            0,
            format!("expected shard {no} of {count}, file says {got_no:?} of {got_count:?}"),
        ));
    }
    Ok(())
}

fn merge_tensors(shards: &[GgufFile]) -> Result<Vec<TensorEntry>> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        for t in &shard.tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(WeightError::tensor(
                    &shard.path,
                    &t.name,
                    "also present in an earlier shard of the split set",
                ));
            }
            out.push(TensorEntry {
                file: i,
                ..t.clone()
            });
        }
    }
    if let Some(expected) = split_key(&shards[0], "split.tensors.count")? {
        if expected != out.len() as u64 {
            return Err(WeightError::malformed(
                &shards[0].path,
                "metadata `split.tensors.count`",
                0,
                format!("says {expected} tensors, the shards hold {}", out.len()),
            ));
        }
    }
    Ok(out)
}
