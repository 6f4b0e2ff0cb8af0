//! Unquantized types: F32, F16 and BF16. Every bit pattern, NaN payloads included, comes out as
//! gguf-py gives it.

use super::block::f16_to_f32;

/// Elements per batch of [`map_elements`].
const BATCH: usize = 16;

/// Maps each little-endian `N`-byte element of `src` through `f`. Fixed batches let LLVM load
/// whole vectors; over single elements it gathered the bytes one by one (1.5x slower on F16).
#[inline(always)]
fn map_elements<const N: usize>(src: &[u8], dst: &mut [f32], f: impl Fn([u8; N]) -> f32) {
    let map = |src: &[u8], dst: &mut [f32]| {
        for (o, b) in dst.iter_mut().zip(src.chunks_exact(N)) {
            // `chunks_exact` makes the conversion infallible.
            if let Ok(b) = b.try_into() {
                *o = f(b);
            }
        }
    };
    for (s, d) in src.chunks_exact(N * BATCH).zip(dst.chunks_exact_mut(BATCH)) {
        map(s, d);
    }
    let done = src.len() / (N * BATCH) * BATCH;
    map(&src[done * N..], &mut dst[done..]);
}

/// F32: a little-endian copy.
pub(super) fn from_f32(src: &[u8], dst: &mut [f32]) {
    map_elements(src, dst, f32::from_le_bytes);
}

/// F16: widened exactly.
pub(super) fn from_f16(src: &[u8], dst: &mut [f32]) {
    map_elements(src, dst, |b| f16_to_f32(u16::from_le_bytes(b)));
}

/// BF16: the top half of an f32.
pub(super) fn from_bf16(src: &[u8], dst: &mut [f32]) {
    map_elements(src, dst, |b| {
        f32::from_bits(u32::from(u16::from_le_bytes(b)) << 16)
    });
}
