//! What the block decoders share: walking blocks as fixed-size arrays, reading little-endian
//! fields, converting f16 the way numpy does, and ggml's 4-bit, 2-bit and codebook layouts.

/// Calls `decode` on each `TS`-byte block and its `BS` outputs. Fixed-size arrays let the compiler
/// drop bounds checks and unroll; the caller has checked that both slices hold whole blocks.
#[inline(always)]
pub(super) fn each_block<const TS: usize, const BS: usize>(
    src: &[u8],
    dst: &mut [f32],
    decode: impl Fn(&[u8; TS], &mut [f32; BS]),
) {
    for (s, d) in src.chunks_exact(TS).zip(dst.chunks_exact_mut(BS)) {
        // `chunks_exact` makes both conversions infallible.
        if let (Ok(s), Ok(d)) = (s.try_into(), d.try_into()) {
            decode(s, d);
        }
    }
}

/// The `BlockDecoder` of a function decoding one `$ts`-byte block into `$bs` values. The block
/// function is inlined into an out-of-line function per block, so that LLVM vectorizes within
/// the block (inlined into the loop over blocks, it vectorizes across blocks instead: a lane per
/// block, strided byte gathers and scalar stores, 1.6x slower on Q4_0). Where the CPU has
/// AVX-512 or AVX2 the blocks go through a copy compiled for it: four or two times the lanes,
/// the same operations in the same order, so the same bits.
macro_rules! blocks {
    ($decode:path, $ts:literal, $bs:literal) => {{
        fn decode(src: &[u8], dst: &mut [f32]) {
            #[inline(never)]
            fn one(b: &[u8; $ts], out: &mut [f32; $bs]) {
                $decode(b, out)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            #[inline(never)]
            fn one_avx2(b: &[u8; $ts], out: &mut [f32; $bs]) {
                $decode(b, out)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
            #[inline(never)]
            fn one_avx512(b: &[u8; $ts], out: &mut [f32; $bs]) {
                $decode(b, out)
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::weights::quant::block::has_avx512() {
                // SAFETY: the CPU has AVX-512 F, BW and VL.
                return $crate::weights::quant::block::each_block(src, dst, |b, out| unsafe {
                    one_avx512(b, out)
                });
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::weights::quant::block::has_avx2() {
                // SAFETY: the CPU has AVX2.
                return $crate::weights::quant::block::each_block(src, dst, |b, out| unsafe {
                    one_avx2(b, out)
                });
            }
            $crate::weights::quant::block::each_block(src, dst, one)
        }
        decode as $crate::weights::quant::BlockDecoder
    }};
}
pub(super) use blocks;

/// Whether the CPU has AVX-512 (F, BW, VL), so that `blocks!` takes its AVX-512 copy (a test
/// can turn it off on its thread to check the other copies).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn has_avx512() -> bool {
    #[cfg(test)]
    if tests::NARROWEST.with(std::cell::Cell::get) >= tests::Copy::Avx2 {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// Whether the CPU has AVX2, so that `blocks!` takes its AVX2 copy (a test can turn it off
/// on its thread to check the plain copy).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn has_avx2() -> bool {
    #[cfg(test)]
    if tests::NARROWEST.with(std::cell::Cell::get) >= tests::Copy::Plain {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx2")
}

/// f16 bits to f32 as numpy converts them: exact, and NaN payloads (signalling ones too) kept,
/// where the F16C instruction, and so `half` on x86, would quiet them. Branch-free so that it
/// vectorizes, and free of subnormal arithmetic, which is slow on some CPUs.
#[inline(always)]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    // The f16 exponent and mantissa moved into f32 position; rebiasing is then an addition.
    let o = u32::from(h & 0x7fff) << 13;
    let exp = o & (0x1f << 23);
    let normal = o + (112 << 23);
    let inf_nan = o + (224 << 23);
    // A subnormal m · 2^-24 is (2^-14 + m · 2^-24) - 2^-14, both exact f32 normals.
    let magic = f32::from_bits(113 << 23);
    let subnormal = (f32::from_bits(o + (113 << 23)) - magic).to_bits();
    let bits = if exp == 0x1f << 23 {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(u32::from(h & 0x8000) << 16 | bits)
}

/// The little-endian u16 at byte `at`.
#[inline(always)]
pub(super) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The little-endian u32 at byte `at`.
#[inline(always)]
pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The f16 scale at byte `at`, as f32.
#[inline(always)]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16_at(b, at))
}

/// ggml's 4-bit layout: byte `i` of `q` holds element `i` in its low nibble and element
/// `i + q.len()` in its high one. `f(nibble, half, i)` gives the value; `half` is 0 or 1.
#[inline(always)]
pub(super) fn nibbles_at(q: &[u8], out: &mut [f32], f: impl Fn(u8, usize, usize) -> f32) {
    let (lo, hi) = out.split_at_mut(q.len());
    for (i, ((&b, l), h)) in q.iter().zip(lo).zip(hi).enumerate() {
        *l = f(b & 0x0f, 0, i);
        *h = f(b >> 4, 1, i);
    }
}

/// [`nibbles_at`] for values that do not depend on the position within the half.
#[inline(always)]
pub(super) fn nibbles(q: &[u8], out: &mut [f32], f: impl Fn(u8, usize) -> f32) {
    nibbles_at(q, out, |n, half, _| f(n, half));
}

/// Nibble `j` of a packed array of 4-bit fields, low nibble first.
#[inline(always)]
pub(super) fn nibble(b: &[u8], j: usize) -> u8 {
    (b[j / 2] >> (4 * (j % 2))) & 0x0f
}

/// ggml's 2-bit layout: each 32 bytes hold 128 elements as four rows of 32, row `r` at bits `2r`.
/// `f(crumb, row, i)` gives element `i` of `row`, counting rows over the whole of `out`.
#[inline(always)]
pub(super) fn crumb_rows(q: &[u8], out: &mut [f32], f: impl Fn(u8, usize, usize) -> f32) {
    for (h, (o, q)) in out
        .chunks_exact_mut(128)
        .zip(q.chunks_exact(32))
        .enumerate()
    {
        for (i, &b) in q.iter().enumerate() {
            for r in 0..4 {
                o[32 * r + i] = f((b >> (2 * r)) & 3, 4 * h + r, i);
            }
        }
    }
}

/// The 4-bit codebook types (IQ4_NL, IQ4_XS, MXFP4, NVFP4): each nibble picks an integer level,
/// scaled by `d` in f32. The 16 products are formed once per group; they are the same products.
#[inline(always)]
pub(super) fn codebook_nibbles(d: f32, levels: &[i8; 16], q: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if q.len().is_multiple_of(8) && out.len() == 2 * q.len() && has_avx2() {
        // SAFETY: the CPU has AVX2; `out` holds two values per byte of `q`, which comes in
        // whole steps of 8 bytes.
        unsafe { lookup_nibbles_avx2(d, levels, q, out) };
        return;
    }
    let lut = levels.map(|k| d * f32::from(k));
    nibbles(q, out, |n, _| lut[usize::from(n)]);
}

/// [`nibbles`] through the table of `d × level` eight nibbles at a time: each half of the table
/// is one register, permuted by the nibbles' low three bits and the two results blended by
/// their fourth (a table lookup per value does not vectorize). The table is formed in registers
/// (through memory, its 16 products stalled every block's first loads), with the same products.
/// `q.len()` is a multiple of 8 and `out` twice as long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lookup_nibbles_avx2(d: f32, levels: &[i8; 16], q: &[u8], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let levels = _mm_loadu_si128(levels.as_ptr().cast());
    let scaled = |eight| {
        _mm256_mul_ps(
            _mm256_set1_ps(d),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)),
        )
    };
    let (low_table, high_table) = (scaled(levels), scaled(_mm_srli_si128::<8>(levels)));
    let n = q.len();
    for (c, bytes) in q.chunks_exact(8).enumerate() {
        let codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.as_ptr().cast()));
        let halves = [
            _mm256_and_si256(codes, _mm256_set1_epi32(0x0f)),
            _mm256_srli_epi32::<4>(codes),
        ];
        for (half, nibble) in halves.into_iter().enumerate() {
            let low = _mm256_permutevar8x32_ps(low_table, nibble);
            let high = _mm256_permutevar8x32_ps(high_table, nibble);
            // Bit 3 of the nibble moved to the sign bit, which selects `high`.
            let upper = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(nibble));
            let at = half * n + 8 * c;
            _mm256_storeu_ps(
                out[at..at + 8].as_mut_ptr(),
                _mm256_blendv_ps(low, high, upper),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix;
    use crate::weights::quant::dequantize;
    use crate::weights::quantize::random_blocks;
    use crate::weights::GgmlType;

    /// The copies of a `blocks!` decoder, widest first.
    #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
    pub(super) enum Copy {
        Widest,
        Avx2,
        Plain,
    }

    thread_local! {
        /// The widest copy `blocks!` decoders on this thread may take.
        pub(super) static NARROWEST: std::cell::Cell<Copy> = const { std::cell::Cell::new(Copy::Widest) };
    }

    /// Every copy of every decoder (AVX-512 and AVX2 where the CPU has them, and the plain one)
    /// gives the same bits (the oracle tests check whichever copy the machine runs against
    /// gguf-py).
    #[test]
    fn every_copy_of_the_decoders_agrees() {
        let block_types: Vec<GgmlType> = GgmlType::all()
            .filter(|&t| t.block_size() > 1 && super::super::block_decoder(t).is_ok())
            .collect();
        assert_eq!(block_types.len(), 23, "every type `blocks!` decodes");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for ty in block_types {
            let src = random_blocks(ty, 64, &mut SplitMix::new(5));
            let decoded: Vec<Vec<u32>> = [Copy::Widest, Copy::Avx2, Copy::Plain]
                .into_iter()
                .map(|copy| {
                    let mut out = vec![0f32; 64 * ty.block_size()];
                    NARROWEST.with(|c| c.set(copy));
                    dequantize(ty, &src, &mut out).unwrap();
                    NARROWEST.with(|c| c.set(Copy::Widest));
                    bits(&out)
                })
                .collect();
            assert_eq!(decoded[0], decoded[2], "{ty}: the widest copy");
            assert_eq!(decoded[1], decoded[2], "{ty}: the AVX2 copy");
        }
    }

    #[test]
    fn f16_conversion_keeps_every_bit_pattern() {
        // Every half round-trips through f32 (via `half`'s exact f32 → f16 for non-NaNs).
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if f.is_nan() {
                let expected =
                    (u32::from(h & 0x8000) << 16) | 0x7f80_0000 | (u32::from(h & 0x3ff) << 13);
                assert_eq!(f.to_bits(), expected, "{h:#06x}");
            } else {
                assert_eq!(half::f16::from_f32(f).to_bits(), h, "{h:#06x}");
            }
        }
    }

    #[test]
    fn crumb_rows_follow_ggml_order() {
        let q: Vec<u8> = (0..64)
            .map(|i| if i == 33 { 0b1110_0100 } else { 0 })
            .collect();
        let mut out = [0.0; 256];
        crumb_rows(&q, &mut out, |c, row, i| {
            f32::from(c) + (100 * row + i) as f32 / 1000.0
        });
        // Byte 33 is element 1 of rows 4..8, i.e. elements 128 + 32r + 1, with crumbs 0, 1, 2, 3.
        for r in 0..4 {
            assert_eq!(
                out[128 + 32 * r + 1],
                r as f32 + (100 * (4 + r) + 1) as f32 / 1000.0
            );
        }
        assert_eq!(out[1], 0.001);
    }

    #[test]
    fn nibbles_put_low_halves_first() {
        let mut out = [0.0; 4];
        nibbles(&[0x21, 0x43], &mut out, |n, half| {
            f32::from(n) + 10.0 * half as f32
        });
        assert_eq!(out, [1.0, 3.0, 12.0, 14.0]);
    }
}
