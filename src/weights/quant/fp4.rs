//! The 4-bit float types: E2M1 values (doubled to integers) times a power-of-two E8M0 scale
//! (MXFP4) or an unsigned E4M3 scale (NVFP4), both halved to undo the doubling.

use super::block::codebook_nibbles;
use super::grids::E2M1_VALUES;

/// Half of an E8M0 scale, 2^(e - 128), built from bits as ggml does; exponents 0 and 1 give
/// subnormals.
#[inline(always)]
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000 << e
    } else {
        u32::from(e - 1) << 23
    };
    f32::from_bits(bits)
}

/// Half of an unsigned E4M3 scale (bias 7; bit 7 ignored; 0 and 0x7f, the NaN, read as zero).
const fn ue4m3_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let (exp, man) = ((x >> 3) & 0x0f, (x & 7) as f32);
    let raw = if exp == 0 {
        man * (1.0 / 512.0)
    } else {
        (1.0 + man / 8.0) * f32::from_bits(((exp + 120) as u32) << 23)
    };
    raw * 0.5
}

/// [`ue4m3_half`] of every byte, computed at compile time with the same exact f32 operations.
static UE4M3_HALF: [f32; 256] = {
    let mut table = [0.0; 256];
    let mut x = 0;
    while x < 256 {
        table[x] = ue4m3_half(x as u8);
        x += 1;
    }
    table
};

/// MXFP4: an E8M0 exponent byte, then 16 bytes of E2M1 nibbles.
#[inline(always)]
pub(super) fn mxfp4(b: &[u8; 17], out: &mut [f32; 32]) {
    codebook_nibbles(e8m0_half(b[0]), &E2M1_VALUES, &b[1..], out);
}

/// NVFP4: four UE4M3 scale bytes, then per 16 elements 8 bytes of E2M1 nibbles.
#[inline(always)]
pub(super) fn nvfp4(b: &[u8; 36], out: &mut [f32; 64]) {
    for ((o, q), &s) in out
        .chunks_exact_mut(16)
        .zip(b[4..].chunks_exact(8))
        .zip(&b[..4])
    {
        codebook_nibbles(UE4M3_HALF[usize::from(s)], &E2M1_VALUES, q, o);
    }
}
