//! Shard manifests: what an engine says each rank holds of each weight (README, "Shard
//! manifests"), read defensively ([`ShardManifest::read`]: every error names the file and the
//! field). Checking one against the plan is the drill-down's job (`diagnose::manifest`).

use std::collections::BTreeSet;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::{de::Error as _, Deserialize, Deserializer, Serialize, Serializer};

use super::identify::{Dtype, ObservedShard, ShardStats};
use super::plan::elements;
use crate::trace::stats::hex64;
use crate::weights::GgmlType;

/// `format` of a manifest.
pub const FORMAT: &str = "glmcheck-shards";
/// The `version` this glmcheck writes (float shards only).
pub const VERSION: u32 = 1;
/// The version that adds quantized entries ([`QUANT_VERSION`] manifests are read too).
pub const QUANT_VERSION: u32 = 2;
/// Larger files are refused before reading: GLM-5 at TP 64 lists about 30 MB.
const MAX_BYTES: u64 = 1 << 30;
/// Larger degrees are refused: no deployment comes near, and loops run over the ranks.
const MAX_TP: u64 = 4096;
/// More dimensions than any weight has (GGUF allows 4).
const MAX_DIMS: usize = 8;

/// What an engine holds, rank by rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardManifest {
    pub format: String,
    pub version: u32,
    /// Free-form: engine, version, model path.
    #[serde(default)]
    pub producer: serde_json::Map<String, serde_json::Value>,
    pub tp: u64,
    #[serde(default)]
    pub ep: bool,
    pub ranks: Vec<RankShards>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankShards {
    pub rank: u64,
    pub weights: Vec<ShardEntry>,
}

/// One weight as one rank holds it: values in a float `dtype` with their `stats`, or (version
/// 2) a GGUF tensor's raw blocks in `ggml_type`, with their `hash` and `source`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// A checkpoint name (GGUF or Hugging Face) or one of vLLM's merged parameters.
    pub name: String,
    /// The values' shape; for a quantized entry, the bytes' (`[rows, bytes]`, or
    /// `[experts, rows, bytes]`).
    pub shape: Vec<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// FNV-1a 64 of the values' little-endian bytes in `dtype`, or of the raw bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<Hash64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats: Option<ShardStats>,
    /// Version 2: the GGML type of raw GGUF bytes (`Q4_K`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ggml_type: Option<String>,
    /// Version 2: where the engine took the bytes from in the file tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<ByteSource>,
    /// Version 2, opt-in: what the engine's own dequantization op made of the bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dequant: Option<EngineDequant>,
}

/// The engine's dequantization of a quantized shard: its output's hash and per-block sums in
/// the engine's dtype, or why the op did not run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineDequant {
    /// The op, as the engine names it (`ggml_dequantize`).
    pub op: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// FNV-1a 64 of the output's little-endian bytes in `dtype`, row-major.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<Hash64>,
    /// The sum of each GGML block's output values, in order: where a mismatch starts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_sums: Vec<f64>,
    /// Why the op did not run (absent from the engine's build); nothing else is then given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub absent: Option<String>,
}

/// Rows (of each expert, for a stacked tensor) and byte columns of a GGUF tensor, `[start,
/// end)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ByteSource {
    pub rows: [u64; 2],
    pub byte_cols: [u64; 2],
}

/// A 64-bit hash written as 16 hex digits: JSON readers keep only 53 bits of a number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hash64(pub u64);

impl Serialize for Hash64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:016x}", self.0))
    }
}

impl<'de> Deserialize<'de> for Hash64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        hex64::parse(&text)
            .map(Hash64)
            .ok_or_else(|| D::Error::custom(format!("hash `{text}` is not 16 hex digits")))
    }
}

impl ShardEntry {
    /// The entry for `values` (f32, row-major) held as `shape` in `dtype`: statistics of the
    /// values in that type, and their hash.
    pub fn of(name: &str, shape: Vec<u64>, values: &[f32], dtype: Dtype) -> ShardEntry {
        let held: Vec<f32> = values.iter().map(|&x| dtype.round(x)).collect();
        ShardEntry {
            name: name.to_string(),
            shape,
            dtype: Some(dtype),
            hash: Some(Hash64(dtype.hash(values))),
            stats: Some(ShardStats::of(&held)),
            ggml_type: None,
            source: None,
            dequant: None,
        }
    }

    /// Raw GGUF bytes rather than values.
    pub fn is_quantized(&self) -> bool {
        self.ggml_type.is_some()
    }

    /// A float entry as the identifier sees it (validated: dtype and stats are present).
    pub fn observed(&self) -> ObservedShard<'_> {
        ObservedShard {
            shape: &self.shape,
            dtype: self.dtype.unwrap_or(Dtype::F32),
            values: None,
            hash: self.hash.map(|h| h.0),
            stats: self.stats.as_ref(),
        }
    }

    /// The first inconsistency, as `field: reason`.
    fn validate(&self, version: u32) -> Result<()> {
        if self.name.is_empty() {
            bail!("name: empty");
        }
        if self.shape.len() > MAX_DIMS {
            bail!("shape: {} dimensions", self.shape.len());
        }
        let Some(n) = elements(&self.shape) else {
            bail!(
                "shape: {:?} has more elements than 64 bits count",
                self.shape
            );
        };
        if let Some(t) = &self.ggml_type {
            return self.validate_quantized(t, version);
        }
        if self.dequant.is_some() {
            bail!("dequant: only a quantized entry (`ggml_type`) has an engine dequantization");
        }
        if self.dtype.is_none() {
            bail!("dtype: missing (or `ggml_type` for raw GGUF bytes)");
        }
        let Some(s) = &self.stats else {
            bail!("stats: missing");
        };
        if s.count != n {
            bail!(
                "stats.count: {} for shape {:?} ({n} elements)",
                s.count,
                self.shape
            );
        }
        let fields = [
            ("mean", s.mean),
            ("std", s.std),
            ("min", s.min),
            ("max", s.max),
            ("absmax", s.absmax),
            ("l2", s.l2),
        ];
        for (field, v) in fields {
            if !v.is_finite() {
                bail!("stats.{field}: {v} is not finite");
            }
            if v < 0.0 && matches!(field, "std" | "absmax" | "l2") {
                bail!("stats.{field}: {v} is negative");
            }
        }
        if s.min > s.max {
            bail!("stats.min: {} is above stats.max {}", s.min, s.max);
        }
        Ok(())
    }

    fn validate_quantized(&self, t: &str, version: u32) -> Result<()> {
        if version < QUANT_VERSION {
            bail!("ggml_type: raw GGUF bytes need `version` {QUANT_VERSION}");
        }
        if GgmlType::from_name(t).is_none() {
            bail!("ggml_type: `{t}` is not a GGML type");
        }
        if self.dtype.is_some() || self.stats.is_some() {
            bail!("ggml_type: a quantized entry has no `dtype` or `stats`");
        }
        if self.hash.is_none() {
            bail!("hash: missing (a quantized entry is identified by it)");
        }
        if let Some(d) = &self.dequant {
            if d.absent.is_none() && (d.dtype.is_none() || d.hash.is_none()) {
                bail!(
                    "dequant: needs `dtype` and `hash`, or `absent` saying why the op did not run"
                );
            }
        }
        if !(2..=3).contains(&self.shape.len()) {
            bail!(
                "shape: {:?} is not [rows, bytes] or [experts, rows, bytes]",
                self.shape
            );
        }
        if let Some(s) = &self.source {
            if s.rows[0] > s.rows[1] || s.byte_cols[0] > s.byte_cols[1] {
                bail!("source: a range ends before it starts");
            }
        }
        Ok(())
    }
}

impl ShardManifest {
    /// Read and check a manifest; an error names the file and the field.
    pub fn read(path: &Path) -> Result<ShardManifest> {
        let at = path.display();
        let size = std::fs::metadata(path)
            .with_context(|| at.to_string())?
            .len();
        if size > MAX_BYTES {
            bail!("{at}: {size} bytes, more than a shard manifest holds");
        }
        let text = std::fs::read_to_string(path).with_context(|| at.to_string())?;
        let m: ShardManifest = serde_json::from_str(&text).map_err(|e| {
            match json_path(&text, e.line(), e.column()) {
                p if p.is_empty() => anyhow!("{at}: {e}"),
                p => anyhow!("{at}: {p}: {e}"),
            }
        })?;
        m.validate().with_context(|| at.to_string())?;
        Ok(m)
    }

    fn validate(&self) -> Result<()> {
        if self.format != FORMAT {
            bail!("format: `{}` is not `{FORMAT}`", self.format);
        }
        if self.version != VERSION && self.version != QUANT_VERSION {
            bail!(
                "version: {} (this glmcheck reads {VERSION} and {QUANT_VERSION})",
                self.version
            );
        }
        if self.tp == 0 || self.tp > MAX_TP {
            bail!("tp: {} is not a degree from 1 to {MAX_TP}", self.tp);
        }
        let mut ranks = BTreeSet::new();
        for (i, r) in self.ranks.iter().enumerate() {
            if r.rank >= self.tp {
                bail!(
                    "ranks[{i}].rank: {} is out of range for tp {}",
                    r.rank,
                    self.tp
                );
            }
            if !ranks.insert(r.rank) {
                bail!("ranks[{i}].rank: rank {} is listed twice", r.rank);
            }
            let mut names = BTreeSet::new();
            for (j, w) in r.weights.iter().enumerate() {
                w.validate(self.version)
                    .map_err(|e| anyhow!("ranks[{i}].weights[{j}].{e}"))?;
                if !names.insert(&w.name) {
                    bail!(
                        "ranks[{i}].weights[{j}].name: `{}` is listed twice on rank {}",
                        w.name,
                        r.rank
                    );
                }
            }
        }
        Ok(())
    }
}

/// The JSON path (`ranks[1].weights[0].stats.mean`) at 1-based `line` and `column` of `text`:
/// where serde stopped, so that a syntax or type error names the field.
fn json_path(text: &str, line: usize, column: usize) -> String {
    enum Frame<'t> {
        Object(Option<&'t str>),
        Array(usize),
    }
    let start: usize = text
        .split_inclusive('\n')
        .take(line.saturating_sub(1))
        .map(str::len)
        .sum();
    let end = (start + column).min(text.len());
    let (b, mut i, mut stack) = (text.as_bytes(), 0, Vec::new());
    while i < end {
        match b[i] {
            b'{' => stack.push(Frame::Object(None)),
            b'[' => stack.push(Frame::Array(0)),
            b'}' | b']' => drop(stack.pop()),
            b',' => match stack.last_mut() {
                Some(Frame::Array(n)) => *n += 1,
                Some(Frame::Object(key)) => *key = None,
                None => {}
            },
            b'"' => {
                let from = i + 1;
                i = from;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                // In an object, the first string after `{` or `,` is the key.
                if let Some(Frame::Object(key @ None)) = stack.last_mut() {
                    *key = text.get(from..i.min(text.len()));
                }
            }
            _ => {}
        }
        i += 1;
    }
    let mut path = String::new();
    for f in &stack {
        match f {
            Frame::Object(Some(k)) if path.is_empty() => path.push_str(k),
            Frame::Object(Some(k)) => path.push_str(&format!(".{k}")),
            Frame::Object(None) => break,
            Frame::Array(n) => path.push_str(&format!("[{n}]")),
        }
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_paths_name_the_field_where_parsing_stopped() {
        let text =
            "{\"ranks\": [{\"rank\": 0}, {\"weights\": [{}, {\"stats\": {\"mean\": NaN}}]}]}";
        let col = text.find("NaN").unwrap() + 1;
        assert_eq!(json_path(text, 1, col), "ranks[1].weights[1].stats.mean");
        let two = "{\"a\": \"x,\\\"y\",\n \"tp\": \"four\"}";
        assert_eq!(json_path(two, 2, 12), "tp");
        assert_eq!(json_path("{}", 1, 0), "");
    }

    #[test]
    fn quantized_entries_need_version_2_a_known_type_and_a_hash() {
        let entry = |version: u32, extra: &str| {
            let text = format!(
                "{{\"format\": \"glmcheck-shards\", \"version\": {version}, \"tp\": 2, \"ranks\": \
                 [{{\"rank\": 0, \"weights\": [{{\"name\": \"blk.0.attn_q_b.weight\", \
                 \"shape\": [192, 88]{extra}}}]}}]}}"
            );
            let m: ShardManifest = serde_json::from_str(&text).unwrap();
            m.validate().map_err(|e| e.to_string())
        };
        let good = ", \"ggml_type\": \"Q5_0\", \"hash\": \"0123456789abcdef\", \
                    \"source\": {\"rows\": [0, 192], \"byte_cols\": [0, 88]}";
        assert_eq!(entry(2, good), Ok(()));
        let err = |version, extra: &str| entry(version, extra).unwrap_err();
        assert!(err(1, good).contains("ggml_type: raw GGUF bytes need `version` 2"));
        assert!(err(
            2,
            ", \"ggml_type\": \"Q9_Z\", \"hash\": \"0123456789abcdef\""
        )
        .contains("`Q9_Z` is not a GGML type"));
        assert!(err(2, ", \"ggml_type\": \"Q5_0\"").contains("hash: missing"));
        assert!(err(2, "").contains("dtype: missing"));
        assert!(err(3, good).contains("this glmcheck reads 1 and 2"));
        // The engine's dequantization: its output, or why it did not run.
        let absent = ", \"dequant\": {\"op\": \"ggml_dequantize\", \"absent\": \"no CUDA\"}";
        assert_eq!(entry(2, &format!("{good}{absent}")), Ok(()));
        let bare = ", \"dequant\": {\"op\": \"ggml_dequantize\", \"dtype\": \"f32\"}";
        assert!(err(2, &format!("{good}{bare}")).contains("dequant: needs `dtype` and `hash`"));
        let float = ", \"dtype\": \"f32\", \"dequant\": {\"op\": \"x\", \"absent\": \"-\"}";
        assert!(err(2, float).contains("dequant: only a quantized entry"));
    }
}
