//! F32, F16 and BF16: one value a block, converted as `ggml_quantize_chunk` converts it.

use super::block::f16_bits;

/// F32: the values' own little-endian bytes.
pub(super) fn to_f32(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.iter().zip(dst.chunks_exact_mut(4)) {
        b.copy_from_slice(&x.to_le_bytes());
    }
}

/// F16: ggml's `ggml_fp32_to_fp16_row`, round to nearest even, overflow to infinity, every NaN
/// the quiet NaN 0x7e00 with its sign.
pub(super) fn to_f16(src: &[f32], dst: &mut [u8]) {
    for (&x, b) in src.iter().zip(dst.chunks_exact_mut(2)) {
        b.copy_from_slice(&f16_bits(x).to_le_bytes());
    }
}

/// BF16: ggml's `ggml_fp32_to_bf16_row_ref` (`ggml_compute_fp32_to_bf16`): NaNs quieted, keeping
/// their top bits; everything else rounded to nearest even, so large finite values may round up
/// to infinity.
pub(super) fn to_bf16(src: &[f32], dst: &mut [u8]) {
    for (&x, b) in src.iter().zip(dst.chunks_exact_mut(2)) {
        b.copy_from_slice(&bf16_bits(x).to_le_bytes());
    }
}

#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let n = x.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        return ((n >> 16) | 0x0040) as u16;
    }
    // Cannot overflow u32: the largest non-NaN pattern, 0xff80_0000, plus 0x8000 fits.
    ((n + 0x7fff + ((n >> 16) & 1)) >> 16) as u16
}
