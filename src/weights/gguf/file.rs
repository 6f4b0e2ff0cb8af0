//! One GGUF file: header, metadata, tensor infos and the data section, parsed from an mmap.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::cursor::Cursor;
use super::value::{Value, ValueType};
use crate::weights::{Encoding, GgmlType, Result, TensorEntry, WeightError};

const MAGIC: &[u8; 4] = b"GGUF";
/// ggml tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;
const DEFAULT_ALIGNMENT: u64 = 32;

/// A parsed GGUF file, its bytes mapped read-only.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensors in file order; `file` is 0 and `offset` is absolute in this file.
    pub tensors: Vec<TensorEntry>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    map: Arc<Mmap>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| WeightError::io(path, e))?;
        // SAFETY: the map is read-only; a file truncated by another process under us is outside
        // what any reader of mmapped weights can defend against (llama.cpp and gguf-py alike).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| WeightError::io(path, e))?;
        let h = parse(path, &map)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: h.version,
            metadata: h.metadata,
            tensors: h.tensors,
            alignment: h.alignment,
            data_offset: h.data_offset,
            map: Arc::new(map),
        })
    }

    /// The bytes of a tensor of this file.
    pub fn bytes(&self, t: &TensorEntry) -> &[u8] {
        &self.map[t.offset as usize..(t.offset + t.nbytes) as usize]
    }

    /// The file's map.
    pub fn map(&self) -> &Arc<Mmap> {
        &self.map
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// What the header says, before the map is attached.
struct Header {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorEntry>,
    alignment: u64,
    data_offset: u64,
}

fn parse(path: &Path, buf: &[u8]) -> Result<Header> {
    let mut c = Cursor::new(path, buf);
    let magic = c.take(4, "magic")?;
    if magic != MAGIC {
        return Err(WeightError::malformed(
            path,
            "magic",
            0,
            format!("{magic:02x?} is not \"GGUF\""),
        ));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(WeightError::malformed(
            path,
            "version",
            4,
            format!("version {version} (glmcheck reads GGUF 2 and 3)"),
        ));
    }
    // A tensor info is at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes;
    // a key/value pair at least 8 (key len) + 4 (type) + 1 byte.
    let n_tensors = c.count("tensor_count", 24)?;
    let n_kv = c.count("metadata_kv_count", 13)?;
    let metadata = read_metadata(&mut c, n_kv)?;
    let alignment = alignment_of(path, &metadata)?;
    let infos = read_tensor_infos(&mut c, n_tensors)?;
    let data_offset = c.pos().div_ceil(alignment) * alignment;
    if data_offset > buf.len() as u64 && !infos.is_empty() {
        return Err(WeightError::malformed(
            path,
            "data section",
            data_offset,
            "starts past the end of the file",
        ));
    }
    let tensors = place_tensors(path, infos, data_offset, alignment, buf.len() as u64)?;
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

fn read_metadata(c: &mut Cursor, n: usize) -> Result<Vec<(String, Value)>> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let at = c.pos();
        let key = c.string(&format!("metadata key #{i}"))?;
        if !seen.insert(key.clone()) {
            return Err(WeightError::malformed(
                c.file(),
                format!("metadata key `{key}`"),
                at,
                "appears twice",
            ));
        }
        let field = format!("metadata `{key}`");
        let id = c.u32(&field)?;
        let ty = ValueType::from_id(id)
            .ok_or_else(|| c.error(&field, format!("unknown value type {id}")))?;
        let value = Value::read(c, ty, &field)?;
        out.push((key, value));
    }
    Ok(out)
}

fn alignment_of(path: &Path, metadata: &[(String, Value)]) -> Result<u64> {
    let Some((_, v)) = metadata.iter().find(|(k, _)| k == "general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match v.as_u64() {
        Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => Ok(a),
        _ => Err(WeightError::malformed(
            path,
            "metadata `general.alignment`",
            0,
            format!("{v} is not a power of two up to 1 MiB"),
        )),
    }
}

/// A tensor info as read, before its offset is checked against the data section.
struct RawInfo {
    name: String,
    ty: GgmlType,
    ne: Vec<u64>,
    rel_offset: u64,
    /// Where the info starts in the file, for error messages.
    at: u64,
}

fn read_tensor_infos(c: &mut Cursor, n: usize) -> Result<Vec<RawInfo>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let at = c.pos();
        let name = c.string(&format!("tensor info #{i} name"))?;
        let field = |what: &str| format!("tensor `{name}` {what}");
        let n_dims = c.u32(&field("n_dims"))?;
        if n_dims > MAX_DIMS {
            return Err(c.error(
                &field("n_dims"),
                format!("{n_dims} dimensions (ggml allows at most {MAX_DIMS})"),
            ));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            ne.push(c.u64(&field("dims"))?);
        }
        let id = c.u32(&field("type"))?;
        let ty = GgmlType::from_id(id)
            .ok_or_else(|| c.error(&field("type"), format!("unknown GGML type id {id}")))?;
        let rel_offset = c.u64(&field("offset"))?;
        out.push(RawInfo {
            name,
            ty,
            ne,
            rel_offset,
            at,
        });
    }
    Ok(out)
}

fn place_tensors(
    path: &Path,
    infos: Vec<RawInfo>,
    data_offset: u64,
    alignment: u64,
    file_len: u64,
) -> Result<Vec<TensorEntry>> {
    let mut names = HashSet::new();
    let mut out = Vec::with_capacity(infos.len());
    for info in infos {
        let bad = |what: &str, reason: String| {
            WeightError::malformed(
                path,
                format!("tensor `{}` {what}", info.name),
                info.at,
                reason,
            )
        };
        if !names.insert(info.name.clone()) {
            return Err(bad("name", "appears twice".into()));
        }
        // The product must fit whatever order it is taken in (the shape multiplies them outermost
        // first), so a zero dim does not excuse huge ones.
        let nonzero = info
            .ne
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let numel = nonzero.map(|n| if info.ne.contains(&0) { 0 } else { n });
        let numel = numel.ok_or_else(|| bad("dims", format!("{:?} overflow", info.ne)))?;
        let row = info.ne.first().copied().unwrap_or(1);
        if row % info.ty.block_size() as u64 != 0 {
            return Err(bad(
                "dims",
                format!(
                    "row of {row} elements is not a whole number of {}-element {} blocks",
                    info.ty.block_size(),
                    info.ty
                ),
            ));
        }
        let nbytes = info
            .ty
            .bytes_for(numel)
            .ok_or_else(|| bad("dims", format!("{:?} overflow", info.ne)))?;
        if info.rel_offset % alignment != 0 {
            return Err(bad(
                "offset",
                format!(
                    "{} is not a multiple of the alignment {alignment}",
                    info.rel_offset
                ),
            ));
        }
        let start = data_offset.checked_add(info.rel_offset);
        let end = start.and_then(|s| s.checked_add(nbytes));
        match (start, end) {
            (Some(start), Some(end)) if end <= file_len => out.push(TensorEntry {
                shape: info.ne.iter().rev().copied().collect(),
                name: info.name,
                encoding: Encoding::Ggml(info.ty),
                file: 0,
                offset: start,
                nbytes,
            }),
            _ => {
                return Err(bad(
                    "offset",
                    format!("data at {}+{} ({nbytes} bytes) runs past the end of the file ({file_len} bytes)", data_offset, info.rel_offset),
                ))
            }
        }
    }
    Ok(out)
}
