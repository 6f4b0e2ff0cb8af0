//! A model's weight files, whatever their format: a GGUF (or split set) or a Hugging Face
//! safetensors checkpoint. Tensors are listed uniformly and dequantized lazily, by row range or
//! expert, reading only the bytes asked for.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::file_read::read_exact_at;
use super::fp8;
use super::gguf::GgufModel;
use super::pages::{self, MappedBytes};
use super::quant;
use super::safetensors::SafetensorsSet;
use super::{Encoding, Result, TensorEntry, WeightError};

/// Values dequantized at a time by [`ModelFiles::for_each_chunk`] (64 MiB of f32).
pub const CHUNK_ELEMS: u64 = 1 << 24;

/// [`ModelFiles::read_into`] reads on up to this many threads, at least this many bytes each.
const READ_THREADS: usize = 8;
const READ_CHUNK: usize = 1 << 20;

/// FP8 checkpoints (GLM-5-FP8, DeepSeek-V3) scale 128×128 tiles.
const FP8_BLOCK: usize = 128;

enum Source {
    Gguf(GgufModel),
    Safetensors(SafetensorsSet),
}

/// The weight files of one model.
pub struct ModelFiles {
    /// What the user named: a `.gguf`, a `.safetensors`, an index or a folder.
    pub path: PathBuf,
    source: Source,
}

impl ModelFiles {
    /// Open `path`: a `.gguf` (any shard of a split set), or a safetensors file, index or folder.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(WeightError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
            ));
        }
        let source = if path.is_file() && has_gguf_magic(path)? {
            Source::Gguf(GgufModel::open(path)?)
        } else {
            Source::Safetensors(SafetensorsSet::open(path)?)
        };
        Ok(ModelFiles {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Human description of the format: `GGUF v3, 2 files` or `safetensors, 1 file`.
    pub fn format(&self) -> String {
        let files = self.files().len();
        let plural = if files == 1 { "" } else { "s" };
        match &self.source {
            Source::Gguf(g) => format!("GGUF v{}, {files} file{plural}", g.shards[0].version),
            Source::Safetensors(_) => format!("safetensors, {files} file{plural}"),
        }
    }

    pub fn gguf(&self) -> Option<&GgufModel> {
        match &self.source {
            Source::Gguf(g) => Some(g),
            Source::Safetensors(_) => None,
        }
    }

    /// The `config.json` beside a safetensors checkpoint, if there is one.
    pub fn hf_config_path(&self) -> Option<PathBuf> {
        let Source::Safetensors(_) = &self.source else {
            return None;
        };
        let dir = if self.path.is_dir() {
            self.path.clone()
        } else {
            self.path.parent()?.to_path_buf()
        };
        Some(dir.join("config.json")).filter(|p| p.is_file())
    }

    pub fn files(&self) -> Vec<PathBuf> {
        match &self.source {
            Source::Gguf(g) => g.paths(),
            Source::Safetensors(s) => s.files.clone(),
        }
    }

    pub fn tensors(&self) -> &[TensorEntry] {
        match &self.source {
            Source::Gguf(g) => &g.tensors,
            Source::Safetensors(s) => &s.tensors,
        }
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        match &self.source {
            Source::Gguf(g) => g.tensors.iter().find(|t| t.name == name),
            Source::Safetensors(s) => s.get(name),
        }
    }

    /// The tensor named `name`, or an error naming the model.
    pub fn require(&self, name: &str) -> Result<&TensorEntry> {
        self.get(name).ok_or_else(|| WeightError::NoSuchTensor {
            file: self.path.clone(),
            tensor: name.into(),
        })
    }

    /// The file holding `t`.
    pub fn file_of(&self, t: &TensorEntry) -> PathBuf {
        match &self.source {
            Source::Gguf(g) => g.shards[t.file].path.clone(),
            Source::Safetensors(s) => s.path(t).to_path_buf(),
        }
    }

    pub fn bytes(&self, t: &TensorEntry) -> &[u8] {
        match &self.source {
            Source::Gguf(g) => g.bytes(t),
            Source::Safetensors(s) => s.bytes(t),
        }
    }

    /// Bytes of `t` from offset `start` (within the tensor) into `out`, by a positioned read of
    /// its file, not through the map: one bulk copy out of the page cache, without faulting
    /// each page into this process (for bytes that are only passed on, as to a GPU). On `Ok`
    /// every byte of `out` is written.
    pub fn read_into(
        &self,
        t: &TensorEntry,
        start: u64,
        out: &mut [MaybeUninit<u8>],
    ) -> Result<()> {
        let path = self.file_of(t);
        let at = t.offset + self.checked(t, start, out.len())?;
        let file = std::fs::File::open(&path).map_err(|e| WeightError::io(&path, e))?;
        // Several reads at once (one thread copies out of the page cache at a few GB/s), on
        // threads of their own: callers may hold a lock that a pool's stolen task would want.
        let per_thread = out.len().div_ceil(READ_THREADS).max(READ_CHUNK);
        if out.len() <= per_thread {
            // One read: no thread to start.
            return read_exact_at(&file, at, out).map_err(|e| WeightError::io(&path, e));
        }
        std::thread::scope(|scope| {
            let reads: Vec<_> = out
                .chunks_mut(per_thread)
                .enumerate()
                .map(|(i, part)| {
                    let file = &file;
                    scope.spawn(move || read_exact_at(file, at + (i * per_thread) as u64, part))
                })
                .collect();
            reads
                .into_iter()
                .try_for_each(|r| r.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        })
        .map_err(|e| WeightError::io(&path, e))
    }

    /// `len` bytes of `t` from offset `start` (within the tensor), read in place in the file's
    /// map: no copy, and out of this process's resident memory again once dropped.
    pub fn mapped(&self, t: &TensorEntry, start: u64, len: usize) -> Result<MappedBytes> {
        let at = (t.offset + self.checked(t, start, len)?) as usize;
        Ok(MappedBytes::new(self.map_of(t).clone(), at..at + len))
    }

    /// `start`, once `len` bytes from it are known to lie within `t`.
    fn checked(&self, t: &TensorEntry, start: u64, len: usize) -> Result<u64> {
        match start.checked_add(len as u64) {
            Some(end) if end <= t.nbytes => Ok(start),
            _ => {
                let why = format!(
                    "{len} bytes from {start} are outside its {} bytes",
                    t.nbytes
                );
                Err(WeightError::tensor(self.file_of(t), &t.name, why))
            }
        }
    }

    /// Tell the kernel rows `rows` of `t` are done with: their mapped pages leave this process's
    /// resident memory (a later read faults them back from the page cache or the file).
    pub fn release_rows(&self, t: &TensorEntry, rows: Range<u64>) {
        let row_bytes = t.nbytes / t.rows().max(1);
        let start = (t.offset + rows.start * row_bytes) as usize;
        let len = ((rows.end - rows.start) * row_bytes) as usize;
        pages::release(self.map_of(t), start..start + len);
    }

    /// The map of the file holding `t`.
    fn map_of(&self, t: &TensorEntry) -> &std::sync::Arc<memmap2::Mmap> {
        match &self.source {
            Source::Gguf(g) => g.map(t),
            Source::Safetensors(s) => s.map(t),
        }
    }

    /// Whether glmcheck can produce f32 values for `t`.
    pub fn can_dequantize(&self, t: &TensorEntry) -> bool {
        match &t.encoding {
            Encoding::Ggml(ty) => ty.can_dequantize(),
            Encoding::F8E4M3 | Encoding::F8E5M2 | Encoding::F8E8M0 => true,
            Encoding::Other(_) => false,
        }
    }

    /// Every element of `t` as f32, in the file's element order.
    pub fn dequantize(&self, t: &TensorEntry) -> Result<Vec<f32>> {
        self.dequantize_rows(t, 0..t.rows())
    }

    /// Rows `rows` of `t` (a row is the innermost dimension), reading only their bytes.
    pub fn dequantize_rows(&self, t: &TensorEntry, rows: Range<u64>) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.dequantize_rows_into(t, rows, &mut out)?;
        Ok(out)
    }

    /// [`Self::dequantize_rows`] with another GGML row decoder (a candidate's, with its bugs).
    pub fn dequantize_rows_with(
        &self,
        t: &TensorEntry,
        rows: Range<u64>,
        decoder: quant::RowDecoder,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.decode_rows_into(t, rows, &mut out, decoder)?;
        Ok(out)
    }

    /// [`Self::dequantize_rows`] into `out`, reusing its allocation (no page faults per chunk).
    pub fn dequantize_rows_into(
        &self,
        t: &TensorEntry,
        rows: Range<u64>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        self.decode_rows_into(t, rows, out, quant::dequantize_rows)
    }

    fn decode_rows_into(
        &self,
        t: &TensorEntry,
        rows: Range<u64>,
        out: &mut Vec<f32>,
        decoder: quant::RowDecoder,
    ) -> Result<()> {
        let fail = |why: String| WeightError::tensor(self.file_of(t), &t.name, why);
        if rows.start > rows.end || rows.end > t.rows() {
            return Err(fail(format!(
                "rows {rows:?} are outside its {} rows",
                t.rows()
            )));
        }
        let row_len = t.row_len();
        let n = usize::try_from((rows.end - rows.start) * row_len)
            .map_err(|_| fail("too large for this machine".into()))?;
        match &t.encoding {
            Encoding::Ggml(ty) => {
                let row_bytes = ty.bytes_for(row_len).ok_or_else(|| {
                    fail(format!("row of {row_len} elements is not whole {ty} blocks, or its byte size overflows"))
                })?;
                let src = &self.bytes(t)
                    [(rows.start * row_bytes) as usize..(rows.end * row_bytes) as usize];
                out.resize(n, 0.0);
                if n > 0 {
                    decoder(*ty, src, out, row_len as usize).map_err(|e| fail(e.to_string()))?;
                }
            }
            Encoding::F8E4M3 | Encoding::F8E5M2 | Encoding::F8E8M0 => {
                *out = self.dequantize_fp8(t, rows)?
            }
            Encoding::Other(name) => return Err(fail(format!("{name} tensors have no f32 form"))),
        }
        Ok(())
    }

    /// Dequantize `t` chunk by chunk (at most [`CHUNK_ELEMS`] values, whole rows), handing each
    /// chunk to `f` in order and releasing its mapped pages after, so that memory stays at one
    /// chunk whatever the tensor's size.
    pub fn for_each_chunk<E: From<WeightError>>(
        &self,
        t: &TensorEntry,
        mut f: impl FnMut(&[f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let rows_per_chunk = (CHUNK_ELEMS / t.row_len().max(1)).max(1);
        let mut start = 0;
        let mut buf = Vec::new();
        while start < t.rows() {
            let rows = start..(start + rows_per_chunk).min(t.rows());
            self.dequantize_rows_into(t, rows.clone(), &mut buf)?;
            f(&buf)?;
            self.release_rows(t, rows.clone());
            start = rows.end;
        }
        Ok(())
    }

    /// Number of chunks [`Self::for_each_chunk`] hands out for `t`.
    pub fn chunk_count(&self, t: &TensorEntry) -> u64 {
        t.rows().div_ceil((CHUNK_ELEMS / t.row_len().max(1)).max(1))
    }

    /// Expert `e` of a stacked `[E, out, in]` expert tensor, reading only that expert's bytes.
    pub fn dequantize_expert(&self, t: &TensorEntry, e: u64) -> Result<Vec<f32>> {
        let [experts, out, _] = t.shape[..] else {
            return Err(WeightError::tensor(
                self.file_of(t),
                &t.name,
                format!("shape {:?} is not [experts, out, in]", t.shape),
            ));
        };
        if e >= experts {
            return Err(WeightError::tensor(
                self.file_of(t),
                &t.name,
                format!("expert {e} is outside its {experts} experts"),
            ));
        }
        self.dequantize_rows(t, e * out..(e + 1) * out)
    }

    fn dequantize_fp8(&self, t: &TensorEntry, rows: Range<u64>) -> Result<Vec<f32>> {
        let Source::Safetensors(set) = &self.source else {
            return Err(WeightError::tensor(
                self.file_of(t),
                &t.name,
                "FP8 outside safetensors",
            ));
        };
        let rows = rows.start as usize..rows.end as usize;
        if let Some(scale) = set.get(&format!("{}_scale_inv", t.name)) {
            return fp8::dequant_block_scaled(set, t, scale, rows, FP8_BLOCK);
        }
        // No block scales (or the scales themselves, as F8_E8M0): the bytes are the values.
        let convert = match t.encoding {
            Encoding::F8E4M3 => fp8::f8e4m3_to_f32,
            Encoding::F8E5M2 => fp8::f8e5m2_to_f32,
            _ => fp8::f8e8m0_to_f32,
        };
        let row_len = t.row_len() as usize;
        Ok(set.bytes(t)[rows.start * row_len..rows.end * row_len]
            .iter()
            .map(|&b| convert(b))
            .collect())
    }
}

fn has_gguf_magic(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(|e| WeightError::io(path, e))?;
    let n = f.read(&mut magic).map_err(|e| WeightError::io(path, e))?;
    Ok(n == 4 && &magic == b"GGUF" || path.extension().is_some_and(|e| e == "gguf"))
}
