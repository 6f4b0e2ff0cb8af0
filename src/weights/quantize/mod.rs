//! From f32 weights to GGML blocks: the inverse of [`crate::weights::quant`], for synthetic
//! models in any storage type, planted faults that round-trip a weight through its storage
//! type, and `verify`'s re-stored reference.
//!
//! Every quantizer here writes llama.cpp's bytes bit for bit: what ggml's
//! `ggml_quantize_chunk(type, …, imatrix = NULL)` writes, which is what `llama-quantize` stores
//! without `--imatrix`. That holds for F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K,
//! Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0 and MXFP4. Each follows the C function that
//! path runs (`quantize_row_<type>_ref` for the legacy, K, ternary and MXFP4 types, with ggml's
//! `make_qkx2_quants`, `make_q3_quants` and `make_qx_quants` scale fits;
//! `quantize_row_iq4_nl_impl` for IQ4_NL and IQ4_XS; ggml's own f16 and bf16 conversions), in
//! f32 with C's order of operations, ggml's `nearest_int` rounding and x86-64's float to integer
//! casts. `tests/llamacpp/quantize_llamacpp.rs` holds every type to the bytes of ggml itself (the
//! llama.cpp that `scripts/setup-llamacpp` builds) over Gaussian rows of several scales,
//! heavy-tailed and outlier rows, zero, constant, one-signed, subnormal and rounding-tie blocks.
//!
//! Bit-exactness assumes ggml compiled as llama.cpp builds it for x86-64: without `-ffast-math`
//! and without fused multiply-adds in `ggml-quants.c`. A ggml built where the C compiler
//! contracts `a * b + c` into FMA (some AArch64 builds) can differ in the last bit of a scale fit
//! and so in a code. NaN inputs are outside the promise too: which NaN an operation returns is
//! not fixed across compilers.
//!
//! Types without a quantizer are written as [`random_blocks`] instead.

mod block;
mod float;
mod iq4;
mod kquants;
mod legacy;
mod mxfp4;
mod random;
mod ternary;

use rayon::prelude::*;

use crate::weights::GgmlType;

pub use random::random_blocks;

/// Why values could not be quantized or an override read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantizeError {
    #[error("no quantizer for {0}: write random blocks instead")]
    NoQuantizer(GgmlType),
    #[error(
        "{ty}: row length {row_len} is not a positive multiple of the block size {block_size}"
    )]
    RowLength {
        ty: GgmlType,
        row_len: usize,
        block_size: usize,
    },
    #[error("{len} values are not a whole number of rows of {row_len}")]
    PartialRow { len: usize, row_len: usize },
    #[error("dequantizing the round trip: {0}")]
    Dequantize(#[from] crate::weights::quant::QuantError),
}

/// Quantize `values`, whole rows of `row_len` elements, as `ty`: the bytes of a GGUF tensor.
///
/// Every quantizer here works block by block, so the blocks are spread over the rayon pool in
/// fixed chunks: the bytes do not depend on the number of threads.
pub fn quantize(ty: GgmlType, values: &[f32], row_len: usize) -> Result<Vec<u8>, QuantizeError> {
    let encode = block_encoder(ty)?;
    let bs = ty.block_size();
    if row_len == 0 || !row_len.is_multiple_of(bs) {
        return Err(QuantizeError::RowLength {
            ty,
            row_len,
            block_size: bs,
        });
    }
    if !values.len().is_multiple_of(row_len) {
        return Err(QuantizeError::PartialRow {
            len: values.len(),
            row_len,
        });
    }
    let ts = ty.type_size();
    let mut out = vec![0u8; values.len() / bs * ts];
    // About 16 Ki values a chunk: enough work to amortize rayon, small enough to balance.
    let blocks_per_chunk = (16384 / bs).max(1);
    values
        .par_chunks(blocks_per_chunk * bs)
        .zip(out.par_chunks_mut(blocks_per_chunk * ts))
        .for_each(|(src, dst)| encode(src, dst));
    Ok(out)
}

/// `values`, whole blocks of `ty`, quantized on this thread: the same bytes [`quantize`] gives
/// them in any row (every quantizer here works block by block), for callers that spread small
/// pieces over the pool themselves.
pub fn quantize_blocks(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>, QuantizeError> {
    let encode = block_encoder(ty)?;
    let bs = ty.block_size();
    if !values.len().is_multiple_of(bs) {
        return Err(QuantizeError::PartialRow {
            len: values.len(),
            row_len: bs,
        });
    }
    let mut out = vec![0u8; values.len() / bs * ty.type_size()];
    encode(values, &mut out);
    Ok(out)
}

/// An encoder of whole blocks: `src` holds whole blocks of values and `dst` their bytes.
type BlockEncoder = fn(&[f32], &mut [u8]);

fn block_encoder(ty: GgmlType) -> Result<BlockEncoder, QuantizeError> {
    use GgmlType as T;
    Ok(match ty {
        T::F32 => float::to_f32,
        T::F16 => float::to_f16,
        T::BF16 => float::to_bf16,
        T::Q4_0 => legacy::q4_0,
        T::Q4_1 => legacy::q4_1,
        T::Q5_0 => legacy::q5_0,
        T::Q5_1 => legacy::q5_1,
        T::Q8_0 => legacy::q8_0,
        T::TQ1_0 => ternary::tq1_0,
        T::TQ2_0 => ternary::tq2_0,
        T::MXFP4 => mxfp4::mxfp4,
        T::Q2_K => kquants::q2_k,
        T::Q3_K => kquants::q3_k,
        T::Q4_K => kquants::q4_k,
        T::Q5_K => kquants::q5_k,
        T::Q6_K => kquants::q6_k,
        T::IQ4_NL => iq4::iq4_nl,
        T::IQ4_XS => iq4::iq4_xs,
        _ => return Err(QuantizeError::NoQuantizer(ty)),
    })
}

/// llama.cpp's replacement when rows are not whole blocks of `ty`: the 256-blocks fall back to a
/// 32-block type of similar size, then anything still not fitting to F16.
pub fn fallback(ty: GgmlType, row_len: u64) -> GgmlType {
    use GgmlType as T;
    let fits = |t: GgmlType| row_len.is_multiple_of(t.block_size() as u64);
    if fits(ty) {
        return ty;
    }
    let alt = match ty {
        T::Q2_K
        | T::Q3_K
        | T::IQ1_S
        | T::IQ1_M
        | T::IQ2_XXS
        | T::IQ2_XS
        | T::IQ2_S
        | T::IQ3_XXS
        | T::IQ3_S
        | T::IQ4_XS => T::IQ4_NL,
        T::TQ1_0 | T::TQ2_0 => T::Q4_0,
        T::Q4_K => T::Q5_0,
        T::Q5_K => T::Q5_1,
        T::Q6_K => T::Q8_0,
        _ => T::F16,
    };
    if fits(alt) {
        alt
    } else {
        T::F16
    }
}

/// `values` quantized as `ty` in rows of `row_len` (llama.cpp's fallback type where rows are
/// not whole blocks) and dequantized again: what storing them as `ty` leaves of them.
pub fn round_trip(
    ty: GgmlType,
    values: Vec<f32>,
    row_len: usize,
) -> Result<Vec<f32>, QuantizeError> {
    let ty = fallback(ty, row_len as u64);
    if ty == GgmlType::F32 || values.is_empty() {
        return Ok(values);
    }
    let bytes = quantize(ty, &values, row_len)?;
    let mut out = vec![0f32; values.len()];
    crate::weights::quant::dequantize_rows(ty, &bytes, &mut out, row_len)?;
    Ok(out)
}

/// Whether [`quantize`] handles `ty`.
pub fn has_quantizer(ty: GgmlType) -> bool {
    block_encoder(ty).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_table() {
        use GgmlType as T;
        for (ty, row, want) in [
            (T::Q4_K, 512, T::Q4_K),
            (T::Q2_K, 192, T::IQ4_NL),
            (T::Q3_K, 192, T::IQ4_NL),
            (T::IQ2_XXS, 192, T::IQ4_NL),
            (T::IQ4_XS, 192, T::IQ4_NL),
            (T::TQ2_0, 192, T::Q4_0),
            (T::Q4_K, 192, T::Q5_0),
            (T::Q5_K, 192, T::Q5_1),
            (T::Q6_K, 192, T::Q8_0),
            (T::Q4_K, 100, T::F16),
            (T::Q8_0, 100, T::F16),
            (T::IQ4_NL, 48, T::F16),
            (T::BF16, 7, T::BF16),
        ] {
            assert_eq!(fallback(ty, row), want, "{ty} rows of {row}");
        }
    }

    #[test]
    fn rows_must_hold_whole_blocks() {
        let xs = vec![0.5f32; 512];
        assert_eq!(
            quantize(GgmlType::Q8_0, &xs, 256).map(|b| b.len()),
            Ok(2 * 8 * 34)
        );
        assert_eq!(
            quantize(GgmlType::Q4_K, &xs, 128),
            Err(QuantizeError::RowLength {
                ty: GgmlType::Q4_K,
                row_len: 128,
                block_size: 256
            })
        );
        assert!(matches!(
            quantize(GgmlType::Q8_0, &xs, 0),
            Err(QuantizeError::RowLength { .. })
        ));
        assert!(quantize(GgmlType::Q8_0, &xs[..480], 96).is_ok());
        assert_eq!(
            quantize(GgmlType::Q8_0, &xs[..500], 64),
            Err(QuantizeError::PartialRow {
                len: 500,
                row_len: 64
            })
        );
        assert_eq!(
            quantize(GgmlType::IQ2_XXS, &xs, 256),
            Err(QuantizeError::NoQuantizer(GgmlType::IQ2_XXS))
        );
    }
}
