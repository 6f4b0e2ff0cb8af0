//! F32, F16 and BF16: one value a block, converted as gguf-py converts it.

/// F32: the values' own little-endian bytes.
pub(super) fn to_f32(src: &[f32], dst: &mut [u8]) {
    for (x, b) in src.iter().zip(dst.chunks_exact_mut(4)) {
        b.copy_from_slice(&x.to_le_bytes());
    }
}

/// F16: round to nearest even, as numpy's `astype(np.float16)`.
pub(super) fn to_f16(src: &[f32], dst: &mut [u8]) {
    for (&x, b) in src.iter().zip(dst.chunks_exact_mut(2)) {
        b.copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
    }
}

/// BF16 as gguf-py (and ggml's `ggml_compute_fp32_to_bf16`) make it: NaNs quieted, keeping
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
