//! A GGUF (version 3) writer: metadata and tensors in the layout llama.cpp and gguf-py read.

use std::io::{BufWriter, Write};
use std::path::Path;

use super::value::Value;
use crate::weights::GgmlType;

const ALIGNMENT: u64 = 32;

/// A tensor to write: row-major shape (outermost first) and its encoded bytes.
struct PendingTensor {
    name: String,
    ty: GgmlType,
    shape: Vec<u64>,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes one GGUF file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn metadata(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Add a tensor; `shape` is row-major (PyTorch order) and `data` its encoded bytes.
    ///
    /// Panics if the byte length does not match the shape and type: callers build both.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        shape: &[u64],
        data: Vec<u8>,
    ) -> &mut Self {
        let name = name.into();
        let numel: u64 = shape.iter().product();
        assert_eq!(
            ty.bytes_for(numel),
            Some(data.len() as u64),
            "tensor {name}: {ty} bytes do not match shape {shape:?}"
        );
        self.tensors.push(PendingTensor {
            name,
            ty,
            shape: shape.to_vec(),
            data,
        });
        self
    }

    /// Write the file (to a temporary name first, renamed when complete).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("gguf.partial");
        let mut w = BufWriter::new(std::fs::File::create(&tmp)?);
        let written = self.write_to(&mut w);
        written.and_then(|()| w.flush())?;
        drop(w);
        std::fs::rename(&tmp, path)
    }

    fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        let mut pos = 0u64;
        let mut put = |w: &mut dyn Write, bytes: &[u8]| -> std::io::Result<()> {
            pos += bytes.len() as u64;
            w.write_all(bytes)
        };
        put(w, b"GGUF")?;
        put(w, &3u32.to_le_bytes())?;
        put(w, &(self.tensors.len() as u64).to_le_bytes())?;
        put(w, &(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in &self.metadata {
            put(w, &encode_string(key))?;
            put(w, &(value_type_id(value)).to_le_bytes())?;
            put(w, &encode_value(value))?;
        }
        let mut rel = 0u64;
        for t in &self.tensors {
            put(w, &encode_string(&t.name))?;
            put(w, &(t.shape.len() as u32).to_le_bytes())?;
            for d in t.shape.iter().rev() {
                put(w, &d.to_le_bytes())?;
            }
            put(w, &t.ty.id().to_le_bytes())?;
            put(w, &rel.to_le_bytes())?;
            rel = (rel + t.data.len() as u64).div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        let fill_to_alignment = |w: &mut dyn Write, pos: u64| -> std::io::Result<u64> {
            let pad = pos.div_ceil(ALIGNMENT) * ALIGNMENT - pos;
            w.write_all(&vec![0u8; pad as usize])?;
            Ok(pos + pad)
        };
        let mut pos = fill_to_alignment(w, pos)?;
        for t in &self.tensors {
            w.write_all(&t.data)?;
            pos = fill_to_alignment(w, pos + t.data.len() as u64)?;
        }
        Ok(())
    }
}

fn encode_string(s: &str) -> Vec<u8> {
    let mut out = (s.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(s.as_bytes());
    out
}

fn value_type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(..) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn encode_value(v: &Value) -> Vec<u8> {
    match v {
        Value::U8(x) => x.to_le_bytes().to_vec(),
        Value::I8(x) => x.to_le_bytes().to_vec(),
        Value::U16(x) => x.to_le_bytes().to_vec(),
        Value::I16(x) => x.to_le_bytes().to_vec(),
        Value::U32(x) => x.to_le_bytes().to_vec(),
        Value::I32(x) => x.to_le_bytes().to_vec(),
        Value::F32(x) => x.to_le_bytes().to_vec(),
        Value::Bool(x) => vec![u8::from(*x)],
        Value::String(s) => encode_string(s),
        Value::U64(x) => x.to_le_bytes().to_vec(),
        Value::I64(x) => x.to_le_bytes().to_vec(),
        Value::F64(x) => x.to_le_bytes().to_vec(),
        Value::Array(ty, items) => {
            let mut out = (*ty as u32).to_le_bytes().to_vec();
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                out.extend(encode_value(item));
            }
            out
        }
    }
}
