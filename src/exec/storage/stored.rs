//! Weights as the file stores them: a matrix's place in its tensor, and a rank's block of it as
//! whole GGML blocks. A backend turns such a block into the values it multiplies by — the CPU
//! by dequantizing it on the host, a GPU by uploading the blocks (once) and dequantizing them on
//! the device — so a tensor-parallel rank reads only its own shard, never the whole weight.

use std::mem::MaybeUninit;
use std::ops::Range;
use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::exec::mat::Mat;
use crate::weights::file_read::{as_room, filled_vec};
use crate::weights::pages::MappedBytes;
use crate::weights::read_ahead::FileRange;
use crate::weights::{quant, Encoding, GgmlType, ModelFiles, TensorEntry};

/// A block's GGML blocks in place in the file's map, without a copy out of the page cache (a
/// copy took a fifth of a few-token MoE layer): its rows `stride` bytes apart, each row's blocks
/// at `within` of its stride. A block of whole rows lies together; a block of columns (a
/// RowParallel rank's shard) is a view of the rows' whole span, of which it reads only its own
/// blocks, so a rank never copies the other ranks' columns. Dropped, it gives the span's pages
/// back; another rank's view of the same rows faults them in again from the page cache.
pub struct BlockBytes {
    map: MappedBytes,
    rows: usize,
    stride: usize,
    within: Range<usize>,
}

impl BlockBytes {
    /// Bytes of the block's own blocks (what it reads; other ranks' columns are theirs).
    pub fn nbytes(&self) -> usize {
        self.rows * self.within.len()
    }

    /// Row `i`'s blocks.
    ///
    /// # Panics
    /// If `i` is not a row of the block.
    pub fn row(&self, i: usize) -> &[u8] {
        assert!(i < self.rows, "row {i} of a block of {} rows", self.rows);
        &self.map[i * self.stride..][self.within.clone()]
    }

    /// Rows `rows`' blocks, one slice a row.
    pub fn rows(&self, rows: Range<usize>) -> impl Iterator<Item = &[u8]> {
        rows.map(|i| self.row(i))
    }
}

/// A `[rows, cols]` matrix stored as rows `first_row..first_row + rows` of a GGML tensor's 2-D
/// view (`[tensor.rows(), tensor.row_len()]`): a weight, or one expert of a stacked tensor.
#[derive(Clone, Copy)]
pub struct StoredMatrix<'a> {
    files: &'a ModelFiles,
    tensor: &'a TensorEntry,
    ty: GgmlType,
    first_row: u64,
    pub rows: usize,
    pub cols: usize,
}

impl<'a> StoredMatrix<'a> {
    /// Rows `first_row..first_row + rows` of `tensor`, when it is a GGML tensor holding them.
    pub fn new(
        files: &'a ModelFiles,
        tensor: &'a TensorEntry,
        first_row: u64,
        rows: u64,
    ) -> Option<Self> {
        let Encoding::Ggml(ty) = tensor.encoding else {
            return None;
        };
        let row_len = tensor.row_len();
        let fits = first_row.checked_add(rows)? <= tensor.rows();
        let whole_blocks = ty.can_dequantize() && ty.bytes_for(row_len).is_some();
        (fits && whole_blocks).then_some(StoredMatrix {
            files,
            tensor,
            ty,
            first_row,
            rows: usize::try_from(rows).ok()?,
            cols: usize::try_from(row_len).ok()?,
        })
    }

    /// The whole matrix.
    pub fn whole(&self) -> StoredBlock<'a> {
        StoredBlock {
            matrix: *self,
            rows: 0..self.rows,
            cols: 0..self.cols,
        }
    }

    /// Rows `rows` × columns `cols` of the matrix, when the columns are whole blocks.
    pub fn block(&self, rows: Range<usize>, cols: Range<usize>) -> Option<StoredBlock<'a>> {
        let bs = self.ty.block_size();
        let aligned = cols.start.is_multiple_of(bs) && cols.end.is_multiple_of(bs);
        let inside = rows.start <= rows.end
            && rows.end <= self.rows
            && cols.start <= cols.end
            && cols.end <= self.cols;
        (aligned && inside).then_some(StoredBlock {
            matrix: *self,
            rows,
            cols,
        })
    }
}

/// What identifies a block's bytes: the file, the tensor's offset in it, the tensor's rows and
/// the columns.
pub type BlockKey = (PathBuf, u64, Range<u64>, Range<usize>);

/// A block of a [`StoredMatrix`]: rows × a range of whole GGML blocks of each row.
pub struct StoredBlock<'a> {
    matrix: StoredMatrix<'a>,
    rows: Range<usize>,
    cols: Range<usize>,
}

impl StoredBlock<'_> {
    pub fn ty(&self) -> GgmlType {
        self.matrix.ty
    }

    /// `(rows, cols)` of the values it holds.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows.len(), self.cols.len())
    }

    /// What a device keeps these bytes under: no two blocks of any file share it.
    pub fn key(&self) -> BlockKey {
        let m = &self.matrix;
        (
            m.files.file_of(m.tensor),
            m.tensor.offset,
            self.tensor_rows(),
            self.cols.clone(),
        )
    }

    /// The tensor's rows this block covers.
    fn tensor_rows(&self) -> Range<u64> {
        let first = self.matrix.first_row;
        first + self.rows.start as u64..first + self.rows.end as u64
    }

    /// Bytes of one stored row, and the byte range of the block's columns within it.
    fn row_bytes(&self) -> (usize, Range<usize>) {
        let ty = self.matrix.ty;
        let per_value = |n: usize| n / ty.block_size() * ty.type_size();
        (
            per_value(self.matrix.cols),
            per_value(self.cols.start)..per_value(self.cols.end),
        )
    }

    /// The bytes of the file its rows lie in (all of each row's columns).
    pub fn file_range(&self) -> FileRange {
        let m = &self.matrix;
        let (row_bytes, _) = self.row_bytes();
        let rows = self.tensor_rows();
        let start = m.tensor.offset + rows.start * row_bytes as u64;
        let end = m.tensor.offset + rows.end * row_bytes as u64;
        (m.files.file_of(m.tensor), start..end)
    }

    /// Bytes of the block's GGML blocks.
    pub fn nbytes(&self) -> usize {
        let (_, within) = self.row_bytes();
        self.rows.len() * within.len()
    }

    /// The block's GGML blocks, row after row, into `out` ([`Self::nbytes`] long): a
    /// `[rows, cols]` tensor of the same type. A block of whole rows is read from the file
    /// (positioned reads, not through the map); a block of columns is copied out of the map.
    pub fn read_into(&self, out: &mut [u8]) -> Result<()> {
        // SAFETY: `read_to` writes only bytes read from the file.
        self.read_to(unsafe { as_room(out) })
    }

    /// The block's GGML blocks in place in the file's map: the span of its rows, of which a
    /// block of columns reads only its own.
    pub fn blocks(&self) -> Result<BlockBytes> {
        let m = &self.matrix;
        let (row_bytes, within) = self.row_bytes();
        let first = self.tensor_rows().start * row_bytes as u64;
        let span = self.rows.len() * row_bytes;
        Ok(BlockBytes {
            map: m.files.mapped(m.tensor, first, span)?,
            rows: self.rows.len(),
            stride: row_bytes,
            within,
        })
    }

    /// [`Self::read_into`] a new buffer, which nothing but the read writes.
    pub fn read_bytes(&self) -> Result<Vec<u8>> {
        // SAFETY: `read_to` writes every byte or fails.
        unsafe { filled_vec(self.nbytes(), |room| self.read_to(room)) }
    }

    /// [`Self::read_into`] room that need not be initialized: every byte written, or an error.
    fn read_to(&self, out: &mut [MaybeUninit<u8>]) -> Result<()> {
        let m = &self.matrix;
        let (row_bytes, within) = self.row_bytes();
        let first = self.tensor_rows().start * row_bytes as u64;
        if within.len() == row_bytes {
            return Ok(m.files.read_into(m.tensor, first, out)?);
        }
        // A block of columns: its own bytes of each row, out of the rows' span in the map
        // (a positioned read of the span would copy every rank's columns).
        let blocks = self.blocks()?;
        let rows = blocks.rows(0..self.rows.len());
        for (dst, src) in out.chunks_exact_mut(within.len().max(1)).zip(rows) {
            for (d, &b) in dst.iter_mut().zip(src) {
                d.write(b);
            }
        }
        Ok(())
    }

    /// The file and tensor it is read from, as errors name them.
    pub fn origin(&self) -> String {
        let m = &self.matrix;
        format!("{}: {}", m.files.file_of(m.tensor).display(), m.tensor.name)
    }

    /// The block's values in f32, dequantized on the host.
    pub fn dequantize(&self) -> Result<Mat<f32>> {
        let (rows, cols) = self.shape();
        if rows * cols == 0 {
            return Ok(Mat::zeros(rows, cols));
        }
        if self.matrix.ty == GgmlType::F32 && cfg!(target_endian = "little") {
            // The values' own bytes: read straight into the output, without a second buffer of
            // the weight's size and a copy out of it.
            // SAFETY: `read_to` writes every byte or fails.
            let out = unsafe { filled_vec(rows * cols, |room| self.read_to(room)) }?;
            return Ok(Mat::new(rows, cols, out));
        }
        let blocks = self.read_bytes()?;
        let out = quant::dequantize_rows_to_vec(self.matrix.ty, &blocks, cols)
            .with_context(|| self.origin())?;
        Ok(Mat::new(rows, cols, out))
    }
}
