//! Dequantizers from raw GGML blocks to f32, bit-identical to gguf-py's `gguf.quants.dequantize`.
//!
//! Each type's decoder is a plain function over one block, made into a decoder of whole blocks by
//! `blocks!` (with a copy for AVX2); [`dequantize`] dispatches on the type and
//! [`dequantize_rows`] spreads rows over the rayon pool.

mod block;
use block::blocks;
mod float;
mod fp4;
pub(crate) mod grids;
mod iquants;
mod kquants;
mod legacy;
mod stream;
mod ternary;

pub use stream::{stores, Stores};

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::ggml_type::GgmlType;

/// Why a buffer could not be dequantized.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("type {0} has no dequantizer")]
    Unsupported(GgmlType),
    #[error("{ty}: {bytes} bytes is not a whole number of {type_size}-byte blocks")]
    PartialBlock {
        ty: GgmlType,
        bytes: usize,
        type_size: usize,
    },
    #[error("{ty}: {blocks} blocks give {expected} values, output holds {got}")]
    OutputSize {
        ty: GgmlType,
        blocks: usize,
        expected: usize,
        got: usize,
    },
}

/// Dequantize whole blocks of `ty` from `src` into `dst` (`dst.len()` = blocks × block size).
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let decode = block_decoder(ty)?;
    let ts = ty.type_size();
    if !src.len().is_multiple_of(ts) {
        return Err(QuantError::PartialBlock {
            ty,
            bytes: src.len(),
            type_size: ts,
        });
    }
    let blocks = src.len() / ts;
    let expected = blocks * ty.block_size();
    if dst.len() != expected {
        return Err(QuantError::OutputSize {
            ty,
            blocks,
            expected,
            got: dst.len(),
        });
    }
    decode(src, dst);
    Ok(())
}

/// A decoder of whole rows of one type: [`dequantize_rows`] or a candidate's.
pub type RowDecoder = fn(GgmlType, &[u8], &mut [f32], usize) -> Result<(), QuantError>;

/// Dequantize `src` holding whole rows of `row_len` elements, in parallel over chunks of rows.
pub fn dequantize_rows(
    ty: GgmlType,
    src: &[u8],
    dst: &mut [f32],
    row_len: usize,
) -> Result<(), QuantError> {
    rows_by(block_decoder(ty)?, ty, src, dst, row_len)
}

/// [`dequantize_rows`] as a candidate whose Q4_K dequantizer misreads the scales and mins of
/// sub-blocks 4–7 (`--inject dequant-q4k-scales`); other types decode correctly.
pub fn dequantize_rows_misreading_q4k(
    ty: GgmlType,
    src: &[u8],
    dst: &mut [f32],
    row_len: usize,
) -> Result<(), QuantError> {
    let decode = match ty {
        GgmlType::Q4_K => blocks!(kquants::q4_k_misread_upper_scales, 144, 256),
        _ => block_decoder(ty)?,
    };
    rows_by(decode, ty, src, dst, row_len)
}

fn rows_by(
    decode: BlockDecoder,
    ty: GgmlType,
    src: &[u8],
    dst: &mut [f32],
    row_len: usize,
) -> Result<(), QuantError> {
    let rows = Rows::of(ty, src, dst.len(), row_len)?;
    if rows.stream() {
        // SAFETY: the streaming path writes every value of `dst`, each an initialized f32.
        let dst = unsafe { &mut *(std::ptr::from_mut(dst) as *mut [MaybeUninit<f32>]) };
        rows.stream_into(decode, src, dst);
    } else {
        rows.decode_into(decode, src, dst);
    }
    Ok(())
}

/// [`dequantize_rows`] into a new vector. A large one is written once, straight from the
/// decoder's L1 buffer into memory not yet written, without a zero fill first (which cost as
/// much as the decoding).
pub fn dequantize_rows_to_vec(
    ty: GgmlType,
    src: &[u8],
    row_len: usize,
) -> Result<Vec<f32>, QuantError> {
    let decode = block_decoder(ty)?;
    let n = src.len() / ty.type_size() * ty.block_size();
    let rows = Rows::of(ty, src, n, row_len)?;
    if !rows.stream() {
        let mut out = vec![0.0; n];
        rows.decode_into(decode, src, &mut out);
        return Ok(out);
    }
    let mut out = Vec::with_capacity(n);
    rows.stream_into(decode, src, &mut out.spare_capacity_mut()[..n]);
    // SAFETY: `stream_into` wrote all `n` values.
    unsafe { out.set_len(n) };
    Ok(out)
}

/// How whole rows of a type split into the chunks decoded in parallel.
struct Rows {
    bs: usize,
    ts: usize,
    chunk_bytes: usize,
    chunk_values: usize,
    out_bytes: usize,
}

impl Rows {
    /// `src` checked to hold whole rows of `row_len` values of `ty`, decoding to `out_len`
    /// values.
    fn of(ty: GgmlType, src: &[u8], out_len: usize, row_len: usize) -> Result<Rows, QuantError> {
        let (ts, bs) = (ty.type_size(), ty.block_size());
        if row_len == 0 || !row_len.is_multiple_of(bs) || !src.len().is_multiple_of(ts) {
            return Err(QuantError::PartialBlock {
                ty,
                bytes: src.len(),
                type_size: ts,
            });
        }
        let blocks = src.len() / ts;
        if out_len != blocks * bs {
            return Err(QuantError::OutputSize {
                ty,
                blocks,
                expected: blocks * bs,
                got: out_len,
            });
        }
        // Chunks of about 256 KiB of output keep rayon's overhead negligible and the cache warm.
        let rows_per_chunk = (65536 / row_len).max(1);
        Ok(Rows {
            bs,
            ts,
            chunk_bytes: row_len / bs * ts * rows_per_chunk,
            chunk_values: row_len * rows_per_chunk,
            out_bytes: out_len * size_of::<f32>(),
        })
    }

    /// Whether the output is large enough to stream past the cache.
    fn stream(&self) -> bool {
        self.out_bytes >= stream::STREAM_MIN_BYTES
    }

    /// Every value of `dst` written, the chunks in parallel, with ordinary stores.
    fn decode_into(&self, decode: BlockDecoder, src: &[u8], dst: &mut [f32]) {
        src.par_chunks(self.chunk_bytes)
            .zip(dst.par_chunks_mut(self.chunk_values))
            .for_each(|(s, d)| decode(s, d));
    }

    /// Every value of `dst` written, the chunks in parallel, each streamed past the cache.
    fn stream_into(&self, decode: BlockDecoder, src: &[u8], dst: &mut [MaybeUninit<f32>]) {
        src.par_chunks(self.chunk_bytes)
            .zip(dst.par_chunks_mut(self.chunk_values))
            .for_each(|(s, d)| stream::decode_streaming(decode, (self.bs, self.ts), s, d));
    }
}

/// A decoder of whole blocks: `src.len()` is a multiple of the type size and `dst` matches it.
type BlockDecoder = fn(&[u8], &mut [f32]);

fn block_decoder(ty: GgmlType) -> Result<BlockDecoder, QuantError> {
    use GgmlType as T;
    Ok(match ty {
        T::F32 => float::from_f32,
        T::F16 => float::from_f16,
        T::BF16 => float::from_bf16,
        T::Q4_0 => blocks!(legacy::q4_0, 18, 32),
        T::Q4_1 => blocks!(legacy::q4_1, 20, 32),
        T::Q5_0 => blocks!(legacy::q5_0, 22, 32),
        T::Q5_1 => blocks!(legacy::q5_1, 24, 32),
        T::Q8_0 => blocks!(legacy::q8_0, 34, 32),
        T::Q2_K => blocks!(kquants::q2_k, 84, 256),
        T::Q3_K => blocks!(kquants::q3_k, 110, 256),
        T::Q4_K => blocks!(kquants::q4_k, 144, 256),
        T::Q5_K => blocks!(kquants::q5_k, 176, 256),
        T::Q6_K => blocks!(kquants::q6_k, 210, 256),
        T::IQ1_S => blocks!(iquants::iq1_s, 50, 256),
        T::IQ1_M => blocks!(iquants::iq1_m, 56, 256),
        T::IQ2_XXS => blocks!(iquants::iq2_xxs, 66, 256),
        T::IQ2_XS => blocks!(iquants::iq2_xs, 74, 256),
        T::IQ2_S => blocks!(iquants::iq2_s, 82, 256),
        T::IQ3_XXS => blocks!(iquants::iq3_xxs, 98, 256),
        T::IQ3_S => blocks!(iquants::iq3_s, 110, 256),
        T::IQ4_NL => blocks!(iquants::iq4_nl, 18, 32),
        T::IQ4_XS => blocks!(iquants::iq4_xs, 136, 256),
        T::TQ1_0 => blocks!(ternary::tq1_0, 54, 256),
        T::TQ2_0 => blocks!(ternary::tq2_0, 66, 256),
        T::MXFP4 => blocks!(fp4::mxfp4, 17, 32),
        T::NVFP4 => blocks!(fp4::nvfp4, 36, 64),
        T::Q8_1 | T::Q8_K | T::Q1_0 | T::I8 | T::I16 | T::I32 | T::I64 | T::F64 => {
            return Err(QuantError::Unsupported(ty))
        }
    })
}
