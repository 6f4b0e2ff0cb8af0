//! A safetensors writer that streams values in as they are produced, as F32, BF16 or FP8 E4M3.
//!
//! The safetensors crate serializes each tensor from one whole buffer; a stacked expert tensor of
//! GLM-5 is 13 GB as f32, so `dequant --dump` and `synth` write chunk by chunk through this
//! instead. The layout is the plain safetensors one (u64 header length, JSON header padded with
//! spaces to a multiple of 8, then the data), and the crate reads it back in the tests.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use float8::F8E4M3;
use half::bf16;
use serde_json::{json, Map, Value};

/// The element types this writer stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreAs {
    F32,
    /// Rounded to nearest even, as torch's `.to(torch.bfloat16)`.
    Bf16,
    /// FP8 E4M3 ("fn": no infinities), rounded to nearest even as torch's
    /// `.to(torch.float8_e4m3fn)`; values past ±448 saturate (a block-scaled weight has none).
    F8E4M3,
}

impl StoreAs {
    fn name(self) -> &'static str {
        match self {
            StoreAs::F32 => "F32",
            StoreAs::Bf16 => "BF16",
            StoreAs::F8E4M3 => "F8_E4M3",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            StoreAs::F32 => 4,
            StoreAs::Bf16 => 2,
            StoreAs::F8E4M3 => 1,
        }
    }
}

/// Writes the tensors declared at creation, in that order; values arrive through
/// [`Self::write`] and run on from one tensor into the next. [`Self::finish`] checks that exactly
/// the declared number arrived before the file takes its name.
pub struct SafetensorsStreamWriter {
    out: BufWriter<File>,
    tmp: PathBuf,
    path: PathBuf,
    /// (element type, elements) per tensor, in order.
    layout: Vec<(StoreAs, u64)>,
    current: usize,
    left_in_current: u64,
}

impl SafetensorsStreamWriter {
    /// Start `path` with a header for `tensors` (name, element type, row-major shape).
    pub fn create(
        path: &Path,
        tensors: &[(String, StoreAs, Vec<u64>)],
        metadata: &BTreeMap<String, String>,
    ) -> std::io::Result<Self> {
        let mut header = Map::new();
        if !metadata.is_empty() {
            header.insert("__metadata__".into(), json!(metadata));
        }
        let mut offset = 0u64;
        for (name, store, shape) in tensors {
            let bytes = store.size() * shape.iter().product::<u64>();
            header.insert(name.clone(), json!({"dtype": store.name(), "shape": shape, "data_offsets": [offset, offset + bytes]}));
            offset += bytes;
        }
        let mut text = Value::Object(header).to_string().into_bytes();
        text.resize(text.len().div_ceil(8) * 8, b' ');
        let tmp = path.with_extension("safetensors.partial");
        let mut out = BufWriter::with_capacity(1 << 22, File::create(&tmp)?);
        out.write_all(&(text.len() as u64).to_le_bytes())?;
        out.write_all(&text)?;
        let layout: Vec<(StoreAs, u64)> = tensors
            .iter()
            .map(|(_, s, shape)| (*s, shape.iter().product()))
            .collect();
        let left_in_current = layout.first().map_or(0, |l| l.1);
        let mut w = SafetensorsStreamWriter {
            out,
            tmp,
            path: path.to_path_buf(),
            layout,
            current: 0,
            left_in_current,
        };
        w.skip_empty();
        Ok(w)
    }

    fn skip_empty(&mut self) {
        while self.left_in_current == 0 && self.current < self.layout.len() {
            self.current += 1;
            self.left_in_current = self.layout.get(self.current).map_or(0, |l| l.1);
        }
    }

    /// Append values: the next ones of the current tensor, running on into the next tensors.
    pub fn write(&mut self, mut values: &[f32]) -> std::io::Result<()> {
        while !values.is_empty() {
            let Some(&(store, _)) = self.layout.get(self.current) else {
                return Err(std::io::Error::other(
                    "more values than the header declares",
                ));
            };
            let n = (values.len() as u64).min(self.left_in_current) as usize;
            let mut buf = Vec::with_capacity(n * store.size() as usize);
            match store {
                StoreAs::F32 => values[..n]
                    .iter()
                    .for_each(|v| buf.extend_from_slice(&v.to_le_bytes())),
                StoreAs::Bf16 => values[..n]
                    .iter()
                    .for_each(|v| buf.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
                StoreAs::F8E4M3 => values[..n]
                    .iter()
                    .for_each(|v| buf.push(F8E4M3::from_f32(*v).to_bits())),
            }
            self.out.write_all(&buf)?;
            values = &values[n..];
            self.left_in_current -= n as u64;
            self.skip_empty();
        }
        Ok(())
    }

    /// Flush and give the file its name; fails if values are missing.
    pub fn finish(mut self) -> std::io::Result<()> {
        if self.current < self.layout.len() {
            return Err(std::io::Error::other(format!(
                "tensor {} of {} is incomplete",
                self.current,
                self.layout.len()
            )));
        }
        self.out.flush()?;
        drop(self.out);
        std::fs::rename(&self.tmp, &self.path)
    }
}
