//! Unquantized types: F32, F16 and BF16, one element per block. Every bit pattern, NaN payloads
//! included, comes out as gguf-py gives it.

use super::block::{each_block, f16_to_f32};

/// F32: a little-endian copy.
pub(super) fn from_f32(src: &[u8], dst: &mut [f32]) {
    each_block(src, dst, |b: &[u8; 4], out: &mut [f32; 1]| out[0] = f32::from_le_bytes(*b));
}

/// F16: widened exactly.
pub(super) fn from_f16(src: &[u8], dst: &mut [f32]) {
    each_block(src, dst, |b: &[u8; 2], out: &mut [f32; 1]| out[0] = f16_to_f32(u16::from_le_bytes(*b)));
}

/// BF16: the top half of an f32.
pub(super) fn from_bf16(src: &[u8], dst: &mut [f32]) {
    each_block(src, dst, |b: &[u8; 2], out: &mut [f32; 1]| {
        out[0] = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16);
    });
}
