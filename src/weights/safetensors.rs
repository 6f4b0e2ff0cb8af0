//! Hugging Face safetensors checkpoints opened as one set of tensors, however they are split.
//!
//! A checkpoint is a single `.safetensors` file, a folder of them, or a folder whose
//! `model.safetensors.index.json` says which shard holds each tensor. Every file is memory-mapped
//! read-only and its header checked by the `safetensors` crate; this module only adds the file
//! name, the field and the byte offset to the crate's errors, and joins the files.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use super::error::{Result, WeightError};
use super::ggml_type::GgmlType;
use super::tensor::{Encoding, TensorEntry};

/// The index file that names the shard of every tensor of a split checkpoint.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// Bytes of the little-endian header length that opens every safetensors file.
const LEN_BYTES: u64 = 8;

/// All tensors of a checkpoint, whichever of its files they are in.
#[derive(Debug)]
pub struct SafetensorsSet {
    /// The files, indexed by [`TensorEntry::file`].
    pub files: Vec<PathBuf>,
    maps: Vec<Arc<Mmap>>,
    /// Every tensor, sorted by name.
    pub tensors: Vec<TensorEntry>,
    /// The `__metadata__` of the first file.
    pub metadata: BTreeMap<String, String>,
}

impl SafetensorsSet {
    /// Open a `.safetensors` file, a `model.safetensors.index.json`, or a folder holding either.
    ///
    /// A folder with an index is read through the index; other `.safetensors` files beside it
    /// are ignored, as loaders do.
    pub fn open(path: &Path) -> Result<Self> {
        let index = path.join(INDEX_NAME);
        if path.is_dir() && index.is_file() {
            Self::open_index(&index)
        } else if path.is_dir() {
            Self::open_files(folder_files(path)?)
        } else if path.extension().is_some_and(|e| e == "json") {
            Self::open_index(path)
        } else {
            Self::open_files(vec![path.to_path_buf()])
        }
    }

    /// The raw little-endian bytes of a tensor.
    ///
    /// # Panics
    /// If `t` is not an entry of this set.
    pub fn bytes(&self, t: &TensorEntry) -> &[u8] {
        &self.maps[t.file][t.offset as usize..(t.offset + t.nbytes) as usize]
    }

    /// The map of the file holding `t`.
    ///
    /// # Panics
    /// If `t` is not an entry of this set.
    pub fn map(&self, t: &TensorEntry) -> &Arc<Mmap> {
        &self.maps[t.file]
    }

    /// The tensor of this name.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        let i = self
            .tensors
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()?;
        self.tensors.get(i)
    }

    /// The file holding a tensor, to name it in errors.
    ///
    /// # Panics
    /// If `t` is not an entry of this set.
    pub fn path(&self, t: &TensorEntry) -> &Path {
        &self.files[t.file]
    }

    /// Map every file and join their tensors; a name in two files is an error.
    fn open_files(files: Vec<PathBuf>) -> Result<Self> {
        let mut maps = Vec::with_capacity(files.len());
        let mut tensors = Vec::new();
        let mut metadata = None;
        for (i, path) in files.iter().enumerate() {
            let (map, header_len, meta) = map_file(path)?;
            tensors.extend(entries(&meta, header_len, i));
            metadata.get_or_insert_with(|| meta.metadata().clone().unwrap_or_default());
            maps.push(Arc::new(map));
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = tensors.windows(2).find(|w| w[0].name == w[1].name) {
            let first = files[w[0].file].display();
            return Err(WeightError::tensor(
                &files[w[1].file],
                &w[1].name,
                format!("also in {first}"),
            ));
        }
        let metadata = metadata.unwrap_or_default().into_iter().collect();
        Ok(SafetensorsSet {
            files,
            maps,
            tensors,
            metadata,
        })
    }

    /// Open the shards an index names and check that they hold exactly what it maps to them.
    fn open_index(index: &Path) -> Result<Self> {
        let weight_map = read_weight_map(index)?;
        let folder = index.parent().unwrap_or(Path::new(""));
        let mut shards: Vec<PathBuf> = weight_map.values().map(|s| folder.join(s)).collect();
        shards.sort();
        shards.dedup();
        let set = Self::open_files(shards)?;
        set.check_index(index, folder, &weight_map)?;
        Ok(set)
    }

    /// Every mapped tensor is in its shard, and every tensor of the shards is mapped.
    fn check_index(
        &self,
        index: &Path,
        folder: &Path,
        weight_map: &BTreeMap<String, String>,
    ) -> Result<()> {
        for (name, shard) in weight_map {
            let shard = folder.join(shard);
            match self.get(name) {
                None => {
                    let why = format!(
                        "{} maps it here but the shard does not hold it",
                        index.display()
                    );
                    return Err(WeightError::tensor(shard, name, why));
                }
                Some(t) if self.path(t) != shard => {
                    let why = format!("{} maps it to {}", index.display(), shard.display());
                    return Err(WeightError::tensor(self.path(t), name, why));
                }
                Some(_) => {}
            }
        }
        match self
            .tensors
            .iter()
            .find(|t| !weight_map.contains_key(&t.name))
        {
            Some(t) => {
                let why = format!("not in the weight_map of {}", index.display());
                Err(WeightError::tensor(self.path(t), &t.name, why))
            }
            None => Ok(()),
        }
    }
}

/// The `.safetensors` files of a folder, sorted by name.
fn folder_files(folder: &Path) -> Result<Vec<PathBuf>> {
    let io = |e| WeightError::io(folder, e);
    let mut files = Vec::new();
    for item in std::fs::read_dir(folder).map_err(io)? {
        let path = item.map_err(io)?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == "safetensors") {
            files.push(path);
        }
    }
    if files.is_empty() {
        let why = format!("no .safetensors files and no {INDEX_NAME}");
        return Err(io(std::io::Error::new(std::io::ErrorKind::NotFound, why)));
    }
    files.sort();
    Ok(files)
}

/// The `weight_map` of an index file: tensor name → shard file name inside the index's folder.
fn read_weight_map(index: &Path) -> Result<BTreeMap<String, String>> {
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: BTreeMap<String, String>,
    }
    let text = std::fs::read(index).map_err(|e| WeightError::io(index, e))?;
    let parsed: Index = serde_json::from_slice(&text).map_err(|e| {
        WeightError::malformed(index, "index JSON", json_offset(&text, &e), e.to_string())
    })?;
    // A shard must be a plain path below the folder: a hostile index must not reach other files.
    let escapes = |shard: &str| {
        !Path::new(shard)
            .components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
    };
    if let Some((name, shard)) = parsed.weight_map.iter().find(|(_, s)| escapes(s)) {
        let field = format!("weight_map `{name}`");
        return Err(WeightError::malformed(
            index,
            field,
            0,
            format!("shard path `{shard}` leaves the folder"),
        ));
    }
    Ok(parsed.weight_map)
}

/// Map a file read-only and have the crate check its header: the map, header length, header.
fn map_file(path: &Path) -> Result<(Mmap, u64, Metadata)> {
    let file = File::open(path).map_err(|e| WeightError::io(path, e))?;
    // SAFETY: the map is read-only and only ever read as bytes. Another process truncating the
    // file while it is mapped would fault, a risk every mmap-based weight reader accepts.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| WeightError::io(path, e))?;
    let (header_len, meta) =
        SafeTensors::read_metadata(&map).map_err(|e| header_error(path, &map, e))?;
    Ok((map, header_len as u64, meta))
}

/// The entries of one file's header, with offsets made absolute.
fn entries(
    meta: &Metadata,
    header_len: u64,
    file: usize,
) -> impl Iterator<Item = TensorEntry> + '_ {
    let data_start = LEN_BYTES + header_len;
    meta.tensors().into_iter().map(move |(name, info)| {
        let (start, end) = info.data_offsets;
        TensorEntry {
            name,
            encoding: encoding(info.dtype),
            shape: info.shape.iter().map(|&d| d as u64).collect(),
            file,
            offset: data_start + start as u64,
            nbytes: (end - start) as u64,
        }
    })
}

/// The encoding of a safetensors dtype: the plain numeric ones are GGML types byte for byte.
fn encoding(dtype: Dtype) -> Encoding {
    let ggml = match dtype {
        Dtype::F32 => GgmlType::F32,
        Dtype::F16 => GgmlType::F16,
        Dtype::BF16 => GgmlType::BF16,
        Dtype::F64 => GgmlType::F64,
        Dtype::I8 => GgmlType::I8,
        Dtype::I16 => GgmlType::I16,
        Dtype::I32 => GgmlType::I32,
        Dtype::I64 => GgmlType::I64,
        Dtype::F8_E4M3 => return Encoding::F8E4M3,
        Dtype::F8_E5M2 => return Encoding::F8E5M2,
        Dtype::F8_E8M0 => return Encoding::F8E8M0,
        other => return Encoding::Other(other.to_string()),
    };
    Encoding::Ggml(ggml)
}

/// The crate's error with the file, the field and, where known, the byte offset added.
fn header_error(path: &Path, file: &[u8], err: SafeTensorError) -> WeightError {
    let (field, offset, reason) = match Layout::of(file) {
        Some(layout) => layout.explain(err),
        None => (
            "header length".into(),
            0,
            format!(
                "the file has {} bytes, fewer than the 8 it needs",
                file.len()
            ),
        ),
    };
    WeightError::malformed(path, field, offset, reason)
}

/// What is wrong: the field, the byte offset in the file, the reason.
type Fault = (String, u64, String);

/// As much of a rejected file's layout as can be found, to say where the crate's error lies.
struct Layout<'a> {
    file_len: u64,
    header_len: u64,
    /// The header's bytes, or none when its length runs past the end.
    header: &'a [u8],
}

impl<'a> Layout<'a> {
    /// `None` when the file is too short to hold a header length.
    fn of(file: &'a [u8]) -> Option<Self> {
        let header_len = u64::from_le_bytes(file.get(..LEN_BYTES as usize)?.try_into().ok()?);
        let header_end = usize::try_from(header_len.saturating_add(LEN_BYTES)).ok();
        let header = header_end.and_then(|end| file.get(LEN_BYTES as usize..end));
        Some(Layout {
            file_len: file.len() as u64,
            header_len,
            header: header.unwrap_or_default(),
        })
    }

    /// Absolute offset of a byte of the data section.
    fn data_byte(&self, offset: usize) -> u64 {
        (LEN_BYTES + self.header_len).saturating_add(offset as u64)
    }

    fn explain(&self, err: SafeTensorError) -> Fault {
        match err {
            SafeTensorError::HeaderTooLarge | SafeTensorError::InvalidHeaderLength => {
                self.length_fault()
            }
            SafeTensorError::InvalidHeader(e) => (
                "header".into(),
                LEN_BYTES + e.valid_up_to() as u64,
                format!("invalid UTF-8: {e}"),
            ),
            SafeTensorError::InvalidHeaderDeserialization(e) => (
                "header".into(),
                LEN_BYTES + json_offset(self.header, &e),
                format!("invalid header JSON: {e}"),
            ),
            SafeTensorError::InvalidOffset(name) => self.offsets_fault(name),
            SafeTensorError::MetadataIncompleteBuffer => self.coverage_fault(),
            other => self
                .size_fault()
                .unwrap_or_else(|| ("header".into(), LEN_BYTES, other.to_string())),
        }
    }

    fn length_fault(&self) -> Fault {
        let (n, room) = (self.header_len, self.file_len - LEN_BYTES);
        let why = if n > room {
            format!("{n} bytes of header but only {room} bytes follow")
        } else {
            format!("{n} bytes of header is over the safetensors crate's limit")
        };
        ("header length".into(), 0, why)
    }

    /// A tensor's data does not follow the previous one's: a gap, an overlap or a reversal.
    fn offsets_fault(&self, name: String) -> Fault {
        let raw = raw_tensors(self.header);
        let info = raw.iter().find(|(n, _)| *n == name).map(|(_, i)| i);
        let (start, end) = info.map(|i| i.data_offsets).unwrap_or_default();
        let why = format!(
            "[{start}, {end}] do not start where the previous tensor ends, or end before they start"
        );
        (
            format!("tensor `{name}` data_offsets"),
            self.data_byte(start),
            why,
        )
    }

    /// The tensors do not end exactly at the end of the file.
    fn coverage_fault(&self) -> Fault {
        let tensors = raw_tensors(self.header);
        let end = self.data_byte(
            tensors
                .iter()
                .map(|(_, i)| i.data_offsets.1)
                .max()
                .unwrap_or(0),
        );
        let why = format!(
            "tensor data ends at byte {end} but the file has {} bytes",
            self.file_len
        );
        ("data_offsets".into(), end, why)
    }

    /// The first tensor whose shape and dtype do not fill its data offsets exactly.
    fn size_fault(&self) -> Option<Fault> {
        let (name, info) = raw_tensors(self.header)
            .into_iter()
            .find(|(_, i)| needed_bytes(i) != Some(span(i)))?;
        let need = needed_bytes(&info)
            .map_or("an overflowing or fractional number of".into(), |n| {
                n.to_string()
            });
        let (start, end) = info.data_offsets;
        let why = format!(
            "{} {:?} needs {need} bytes, data_offsets [{start}, {end}] hold {}",
            info.dtype,
            info.shape,
            span(&info)
        );
        Some((format!("tensor `{name}` shape"), self.data_byte(start), why))
    }
}

/// The tensors of a header the crate rejected, sorted by data offsets, to find which one it
/// meant: its errors about sizes and offsets do not all name the tensor.
fn raw_tensors(header: &[u8]) -> Vec<(String, TensorInfo)> {
    #[derive(serde::Deserialize)]
    struct RawHeader {
        #[serde(rename = "__metadata__", default)]
        _metadata: serde::de::IgnoredAny,
        #[serde(flatten)]
        tensors: BTreeMap<String, TensorInfo>,
    }
    let mut tensors: Vec<_> = serde_json::from_slice::<RawHeader>(header)
        .map(|h| h.tensors.into_iter().collect())
        .unwrap_or_default();
    tensors.sort_by_key(|(_, i)| i.data_offsets);
    tensors
}

/// Bytes a tensor's shape and dtype need; `None` when that overflows or is not whole bytes.
fn needed_bytes(info: &TensorInfo) -> Option<usize> {
    let bits = info
        .shape
        .iter()
        .try_fold(info.dtype.bitsize(), |acc, &d| acc.checked_mul(d))?;
    (bits % 8 == 0).then_some(bits / 8)
}

/// Bytes between a tensor's data offsets (0 when they are reversed).
fn span(info: &TensorInfo) -> usize {
    info.data_offsets.1.saturating_sub(info.data_offsets.0)
}

/// The byte offset in `text` of a serde_json error, from its 1-based line and column.
fn json_offset(text: &[u8], err: &serde_json::Error) -> u64 {
    let line_start: usize = text
        .split_inclusive(|&b| b == b'\n')
        .take(err.line().saturating_sub(1))
        .map(<[u8]>::len)
        .sum();
    (line_start + err.column().saturating_sub(1)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_offset_counts_lines() {
        let text = b"{\n  \"a\": x\n}";
        let err = serde_json::from_slice::<serde_json::Value>(text).expect_err("bad JSON");
        assert_eq!(text[json_offset(text, &err) as usize], b'x');
    }
}
