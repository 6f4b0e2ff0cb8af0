//! A GGUF (version 3) writer: metadata and tensors in the layout llama.cpp and gguf-py read.
//!
//! Tensors are declared first (name, type, shape) so the header can be written, then their bytes
//! are either held in memory ([`GgufWriter::tensor`]) or produced while the file is written
//! ([`GgufWriter::declare`] with [`GgufWriter::write_streaming`]) — the route for files larger
//! than memory.

use std::io::{BufWriter, Write};
use std::path::Path;

use super::value::Value;
use crate::weights::GgmlType;

const ALIGNMENT: u64 = 32;

/// A tensor to write: row-major shape (outermost first) and, if held in memory, its bytes.
struct PendingTensor {
    name: String,
    ty: GgmlType,
    shape: Vec<u64>,
    nbytes: u64,
    data: Option<Vec<u8>>,
}

/// Collects metadata and tensors, then writes one GGUF file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

/// A writer that counts what passes through it, to check each tensor's byte count.
struct Counting<'a, W: Write> {
    inner: &'a mut W,
    count: u64,
}

impl<W: Write> Write for Counting<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn metadata(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Add a tensor held in memory; `shape` is row-major (PyTorch order), `data` its bytes.
    ///
    /// Panics if the byte length does not match the shape and type: callers build both.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        shape: &[u64],
        data: Vec<u8>,
    ) -> &mut Self {
        let index = self.tensors.len();
        self.declare(name, ty, shape);
        let t = &mut self.tensors[index];
        assert_eq!(
            t.nbytes,
            data.len() as u64,
            "tensor {}: {ty} bytes do not match shape {shape:?}",
            t.name
        );
        t.data = Some(data);
        self
    }

    /// Declare a tensor whose bytes [`Self::write_streaming`] will ask for.
    ///
    /// Panics if the shape is not whole blocks of `ty`: callers choose both.
    pub fn declare(&mut self, name: impl Into<String>, ty: GgmlType, shape: &[u64]) -> &mut Self {
        let name = name.into();
        let nbytes = ty
            .bytes_for(shape.iter().product())
            .unwrap_or_else(|| panic!("tensor {name}: shape {shape:?} is not whole {ty} blocks"));
        self.tensors.push(PendingTensor {
            name,
            ty,
            shape: shape.to_vec(),
            nbytes,
            data: None,
        });
        self
    }

    /// Write the file; every tensor must hold its bytes.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        self.write_streaming(path, |i, _| {
            Err(std::io::Error::other(format!(
                "tensor {} was declared without bytes",
                self.tensors[i].name
            )))
        })
    }

    /// Write the file, asking `fill(i, out)` for the bytes of each declared tensor `i` (in
    /// declaration order) that does not hold its bytes. Written to a temporary name first and
    /// renamed when complete, so a crash never leaves a truncated file under the real name.
    pub fn write_streaming(
        &self,
        path: &Path,
        mut fill: impl FnMut(usize, &mut (dyn Write + Send)) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        let tmp = path.with_extension("gguf.partial");
        let mut w = BufWriter::with_capacity(1 << 22, std::fs::File::create(&tmp)?);
        self.write_header(&mut w)?;
        for (i, t) in self.tensors.iter().enumerate() {
            let mut counted = Counting {
                inner: &mut w,
                count: 0,
            };
            match &t.data {
                Some(data) => counted.write_all(data)?,
                None => fill(i, &mut counted)?,
            }
            if counted.count != t.nbytes {
                return Err(std::io::Error::other(format!(
                    "tensor {}: {} bytes written, {} declared",
                    t.name, counted.count, t.nbytes
                )));
            }
            pad(&mut w, t.nbytes)?;
        }
        w.flush()?;
        drop(w);
        std::fs::rename(&tmp, path)
    }

    fn write_header(&self, w: &mut impl Write) -> std::io::Result<()> {
        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            head.extend(encode_string(key));
            head.extend_from_slice(&value_type_id(value).to_le_bytes());
            head.extend(encode_value(value));
        }
        let mut rel = 0u64;
        for t in &self.tensors {
            head.extend(encode_string(&t.name));
            head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
            for d in t.shape.iter().rev() {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&rel.to_le_bytes());
            rel = (rel + t.nbytes).div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        w.write_all(&head)?;
        pad(w, head.len() as u64)
    }
}

/// Zero bytes after `len` bytes up to the next alignment boundary.
fn pad(w: &mut impl Write, len: u64) -> std::io::Result<()> {
    let fill = len.div_ceil(ALIGNMENT) * ALIGNMENT - len;
    w.write_all(&[0u8; ALIGNMENT as usize][..fill as usize])
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
