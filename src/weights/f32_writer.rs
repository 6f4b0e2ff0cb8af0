//! A safetensors writer for f32 tensors that streams values in as they are produced.
//!
//! The safetensors crate serializes each tensor from one whole buffer; a stacked expert tensor of
//! GLM-5 is 13 GB as f32, so `dequant --dump` writes chunk by chunk through this instead. The
//! layout is the plain safetensors one (u64 header length, JSON header padded with spaces to a
//! multiple of 8, then the data), and the crate reads it back in the tests.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

/// Writes the tensors declared at creation, in that order; [`Self::finish`] checks that exactly
/// the declared number of values arrived before the file takes its name.
pub struct F32SafetensorsWriter {
    out: BufWriter<File>,
    tmp: PathBuf,
    path: PathBuf,
    expected_values: u64,
    written_values: u64,
}

impl F32SafetensorsWriter {
    /// Start `path` with a header for `tensors` (name, row-major shape), in this order.
    pub fn create(path: &Path, tensors: &[(String, Vec<u64>)]) -> std::io::Result<Self> {
        let mut header = Map::new();
        header.insert(
            "__metadata__".into(),
            json!({"producer": "glmcheck dequant"}),
        );
        let mut offset = 0u64;
        for (name, shape) in tensors {
            let bytes = 4 * shape.iter().product::<u64>();
            header.insert(
                name.clone(),
                json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
        }
        let mut text = Value::Object(header).to_string().into_bytes();
        text.resize(text.len().div_ceil(8) * 8, b' ');
        let tmp = path.with_extension("safetensors.partial");
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        out.write_all(&(text.len() as u64).to_le_bytes())?;
        out.write_all(&text)?;
        Ok(F32SafetensorsWriter {
            out,
            tmp,
            path: path.to_path_buf(),
            expected_values: offset / 4,
            written_values: 0,
        })
    }

    /// Append values: the next ones of the current tensor, running on into the next tensor.
    pub fn write(&mut self, values: &[f32]) -> std::io::Result<()> {
        self.written_values += values.len() as u64;
        if self.written_values > self.expected_values {
            return Err(std::io::Error::other(
                "more values than the header declares",
            ));
        }
        for v in values {
            self.out.write_all(&v.to_le_bytes())?;
        }
        Ok(())
    }

    /// Flush and give the file its name; fails if values are missing.
    pub fn finish(mut self) -> std::io::Result<()> {
        if self.written_values != self.expected_values {
            return Err(std::io::Error::other(format!(
                "{} of {} declared values written",
                self.written_values, self.expected_values
            )));
        }
        self.out.flush()?;
        drop(self.out);
        std::fs::rename(&self.tmp, &self.path)
    }
}
