//! A weight as the CPU backend holds it: its values, or its GGML blocks as the file stores them,
//! decoded a task's rows at a time inside the GEMM that reads them.
//!
//! Decoding a whole quantized weight first writes it to memory in f32 (a routed expert of GLM-5
//! is 50 MB of f32 for 7 MB of Q4_K) only for the GEMM to read it back: a cold pass over a MoE
//! layer moved each expert through memory twice. Decoded per task, a block of rows goes from
//! the decoder to the GEMM through the cache. The values are those of the whole decode, rounded
//! the same way, and each task's GEMM is the same call on them, so every output is the same.

use std::cell::RefCell;
use std::ops::Range;

use anyhow::{Context, Result};

use crate::dtype::Precision;
use crate::exec::mat::Mat;
use crate::exec::real::Real;
use crate::exec::storage::stored::{BlockBytes, StoredBlock};
use crate::weights::{quant, GgmlType};

/// A `[rows, cols]` weight of the CPU backend in its number type `E`.
pub enum HostWeight<E> {
    /// Values decoded and rounded to the dtype.
    Values(Mat<E>),
    /// Stored blocks, decoded and rounded where they are read.
    Blocks(Blocks),
}

/// Whole GGML blocks of a `[rows, cols]` weight, row after row, and the precision their values
/// are rounded to once decoded.
pub struct Blocks {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: BlockBytes,
    precision: Precision,
    /// Where the blocks came from, for errors.
    origin: String,
}

impl Blocks {
    /// `w`'s blocks from its file, to be rounded to `precision`.
    pub fn read(w: &StoredBlock<'_>, precision: Precision) -> Result<Blocks> {
        let (rows, cols) = w.shape();
        Ok(Blocks {
            ty: w.ty(),
            rows,
            cols,
            bytes: w.blocks()?,
            precision,
            origin: w.origin(),
        })
    }

    /// Rows `rows` decoded into `out` (`rows.len() × cols` long) and rounded to the precision,
    /// a row at a time: each is rounded while the decoder's writes are still in L1.
    fn decode_rows(&self, rows: Range<usize>, out: &mut [f32]) -> Result<()> {
        for (row, values) in self.bytes.rows(rows).zip(out.chunks_exact_mut(self.cols)) {
            quant::dequantize(self.ty, row, values).with_context(|| self.origin.clone())?;
            self.precision.round_slice_f32(values);
        }
        Ok(())
    }
}

thread_local! {
    /// Each thread's decoded rows, reused from task to task (a task's rows are megabytes: a
    /// fresh buffer each time would be zeroed, or faulted in, each time).
    static DECODED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

impl<E: Real> HostWeight<E> {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            HostWeight::Values(m) => (m.rows, m.cols),
            HostWeight::Blocks(b) => (b.rows, b.cols),
        }
    }

    /// Bytes of memory it holds.
    pub fn bytes(&self) -> usize {
        match self {
            HostWeight::Values(m) => std::mem::size_of_val(m.data()),
            HostWeight::Blocks(b) => b.bytes.nbytes(),
        }
    }

    /// `f` of rows `rows`' values, row after row: a slice of the values, or the rows decoded
    /// into this thread's buffer (for the duration of `f`, which must not start other tasks'
    /// decoding on this thread).
    pub fn with_rows<R>(&self, rows: Range<usize>, f: impl FnOnce(&[E]) -> R) -> Result<R> {
        let (_, cols) = self.shape();
        let blocks = match self {
            HostWeight::Values(m) => return Ok(f(&m.data()[rows.start * cols..rows.end * cols])),
            HostWeight::Blocks(b) => b,
        };
        let n = rows.len() * cols;
        DECODED.with_borrow_mut(|buffer| {
            if buffer.len() < n {
                buffer.resize(n, 0.0);
            }
            let decoded = &mut buffer[..n];
            blocks.decode_rows(rows, decoded)?;
            Ok(match E::from_f32(decoded) {
                Some(values) => f(values),
                None => f(&E::widen_all(decoded.to_vec())),
            })
        })
    }

    /// `f` of rows `rows`' values in pieces of at most `piece` rows, in order, with the rows
    /// of each: values as one piece, already in memory; blocks a piece at a time, each decoded
    /// just before `f` reads it, so that it is read from L2 rather than from memory.
    pub fn with_row_pieces(
        &self,
        rows: Range<usize>,
        piece: usize,
        mut f: impl FnMut(Range<usize>, &[E]) -> Result<()>,
    ) -> Result<()> {
        if let HostWeight::Values(_) = self {
            return self.with_rows(rows.clone(), |w| f(rows, w))?;
        }
        for start in rows.clone().step_by(piece.max(1)) {
            let piece = start..(start + piece).min(rows.end);
            self.with_rows(piece.clone(), |w| f(piece, w))??;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::backend::{Backend, Cpu};
    use crate::exec::storage::stored::StoredMatrix;
    use crate::rng::SplitMix;
    use crate::weights::gguf::writer::GgufWriter;
    use crate::weights::quantize::{has_quantizer, quantize};
    use crate::weights::ModelFiles;

    /// Rows of the stored weights: one whole task of the GEMM, and part of another.
    const ROWS: usize = 300;
    /// Features: two Q4_K blocks, so that a column block of whole blocks exists.
    const COLS: usize = 512;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix::new(seed);
        (0..n).map(|_| rng.normal()).collect()
    }

    fn bits<E: Real>(m: &Mat<E>) -> Vec<u64> {
        m.data()
            .iter()
            .map(|&v| num_traits::ToPrimitive::to_f64(&v).unwrap().to_bits())
            .collect()
    }

    /// How many of two products' outputs differ in any bit.
    fn differing<E: Real>(a: &Mat<E>, b: &Mat<E>) -> usize {
        assert_eq!((a.rows, a.cols), (b.rows, b.cols));
        bits(a).iter().zip(bits(b)).filter(|(x, y)| *x != y).count()
    }

    /// A GGUF holding one `[ROWS, COLS]` weight per type, each quantized from other values.
    fn stored(dir: &std::path::Path, types: &[GgmlType]) -> ModelFiles {
        let mut w = GgufWriter::new();
        for (i, &ty) in types.iter().enumerate() {
            let bytes = quantize(ty, &values(ROWS * COLS, i as u64), COLS).unwrap();
            w.tensor(ty.to_string(), ty, &[ROWS as u64, COLS as u64], bytes);
        }
        let path = dir.join("weights.gguf");
        w.write(&path).unwrap();
        ModelFiles::open(&path).unwrap()
    }

    /// The product through blocks decoded task by task is the product through the values
    /// decoded whole, bit for bit: every type the synthesizer quantizes, every precision the
    /// CPU emulates, token counts for each kernel (few-token, gemm's narrow and wide), a whole
    /// weight, a block of its rows and a block of its columns (a rank's shard).
    #[test]
    fn blocks_decoded_per_task_multiply_as_the_values_decoded_whole() {
        let dir = tempfile::tempdir().unwrap();
        let types: Vec<GgmlType> = [
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q4_0,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::IQ4_XS,
        ]
        .into_iter()
        .filter(|&ty| has_quantizer(ty))
        .collect();
        assert!(types.len() >= 6, "quantizers for {types:?} only");
        let files = stored(dir.path(), &types);
        for ty in types {
            let t = files.require(&ty.to_string()).unwrap();
            let m = StoredMatrix::new(&files, t, 0, ROWS as u64).unwrap();
            let blocks = [
                m.whole(),
                m.block(40..ROWS, 0..COLS).unwrap(),
                m.block(0..ROWS, 256..COLS).unwrap(),
            ];
            for precision in [Precision::F32, Precision::Bf16, Precision::F16] {
                let be = Cpu::new(precision);
                for b in &blocks {
                    let by_blocks = be.hold_stored(b).unwrap();
                    assert!(
                        matches!(by_blocks, HostWeight::Blocks(_)),
                        "{ty}: not blocks"
                    );
                    let by_values = be.hold(b.dequantize().unwrap()).unwrap();
                    for tokens in [1, 3, 17, 40] {
                        let x = Mat::new(tokens, b.shape().1, values(tokens * b.shape().1, 9));
                        let want = be.linear_exact(&x, &by_values).unwrap();
                        let by_blocks = be.hold_stored(b).unwrap();
                        let got = be.linear_exact(&x, &by_blocks).unwrap();
                        let case = format!("{ty} {precision:?} {:?} {tokens} tokens", b.shape());
                        assert_eq!(differing(&got, &want), 0, "{case}: outputs differ");
                    }
                }
            }
            // f64, the selftest's reference: widened after decoding, as the values are.
            let be = Cpu::f64();
            let x = Mat::new(
                5,
                COLS,
                values(5 * COLS, 3).into_iter().map(f64::from).collect(),
            );
            let want = be.linear_exact(&x, &be.hold(m.whole().dequantize().unwrap()).unwrap());
            let got = be.linear_exact(&x, &be.hold_stored(&m.whole()).unwrap());
            assert_eq!(differing(&got.unwrap(), &want.unwrap()), 0, "{ty} f64");
        }
    }

    /// f32 weights are held as their values: there is nothing to decode.
    #[test]
    fn f32_weights_are_held_as_values() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = GgufWriter::new();
        let v = values(4 * 32, 1);
        w.tensor(
            "w",
            GgmlType::F32,
            &[4, 32],
            bytemuck::cast_slice(&v).to_vec(),
        );
        let path = dir.path().join("f32.gguf");
        w.write(&path).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        let m = StoredMatrix::new(&files, files.require("w").unwrap(), 0, 4).unwrap();
        let held = Cpu::new(Precision::F32).hold_stored(&m.whole()).unwrap();
        let HostWeight::Values(held) = held else {
            panic!("f32 held as blocks");
        };
        assert_eq!(held.data(), v);
    }
}
