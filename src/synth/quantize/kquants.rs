//! The K-quants through candle's ports of ggml's reference quantizers (`quantize_row_q*_K_ref`),
//! whose `#[repr(C)]` blocks are ggml's on-disk layout.

use candle_core::quantized::k_quants::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, GgmlType as CandleBlock,
};

pub(super) fn q2_k(src: &[f32], dst: &mut [u8]) {
    candle::<BlockQ2K>(src, dst);
}

pub(super) fn q3_k(src: &[f32], dst: &mut [u8]) {
    candle::<BlockQ3K>(src, dst);
}

pub(super) fn q4_k(src: &[f32], dst: &mut [u8]) {
    candle::<BlockQ4K>(src, dst);
}

pub(super) fn q5_k(src: &[f32], dst: &mut [u8]) {
    candle::<BlockQ5K>(src, dst);
}

pub(super) fn q6_k(src: &[f32], dst: &mut [u8]) {
    candle::<BlockQ6K>(src, dst);
}

// Each block struct is exactly ggml's 256-element block (the type sizes of gguf-py's table): no
// padding, so its bytes are the file's bytes.
const _: () = {
    assert!(size_of::<BlockQ2K>() == 84 && BlockQ2K::BLCK_SIZE == 256);
    assert!(size_of::<BlockQ3K>() == 110 && BlockQ3K::BLCK_SIZE == 256);
    assert!(size_of::<BlockQ4K>() == 144 && BlockQ4K::BLCK_SIZE == 256);
    assert!(size_of::<BlockQ5K>() == 176 && BlockQ5K::BLCK_SIZE == 256);
    assert!(size_of::<BlockQ6K>() == 210 && BlockQ6K::BLCK_SIZE == 256);
};

/// Quantize whole blocks with candle's block type `B` and copy the blocks' bytes out.
fn candle<B: CandleBlock>(src: &[f32], dst: &mut [u8]) {
    let mut blocks = vec![B::zeros(); src.len() / B::BLCK_SIZE];
    B::from_float(src, &mut blocks);
    dst.copy_from_slice(block_bytes(&blocks));
}

/// The bytes of candle's K-quant blocks.
fn block_bytes<B: CandleBlock>(blocks: &[B]) -> &[u8] {
    // SAFETY: `B` is one of the five `#[repr(C)]` K-quant blocks asserted above to have no
    // padding; their fields are u8/i8 arrays and f16, so every byte is initialized and any
    // alignment is at least u8's. The slice borrows `blocks` and covers exactly its memory.
    unsafe { std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), size_of_val(blocks)) }
}
