//! Valid random blocks of any dequantizable type, for models written at disk speed: random bytes
//! with only the scale fields tamed, since every bit pattern of the codes is a valid code.
//!
//! The per-type scale fields are those of the tests' `glmcheck_oracle.formats.quant_blocks`; the
//! dequantization of the result is finite everywhere (largest |value| about 2^6 · 2^8 · 2^7 for
//! IQ4_XS).

use rayon::prelude::*;

use crate::rng::SplitMix;
use crate::weights::GgmlType;

/// `n_blocks` random blocks of `ty`, deterministic from `rng`: the codes random, the f16 scales
/// of magnitude 2^-14 to 2^6 or zero (1 in 16), half negative; MXFP4's exponent at most 250;
/// F32/F16/BF16 values of magnitude 2^-8 to 2^8. Types glmcheck cannot dequantize (which no mix
/// or override picks) get plain random bytes.
pub fn random_blocks(ty: GgmlType, n_blocks: usize, rng: &mut SplitMix) -> Vec<u8> {
    let ts = ty.type_size();
    let mut buf = vec![0u8; n_blocks * ts];
    // About 1 MiB of whole blocks a chunk, each chunk from its own generator seeded from `rng` in
    // order: filled in parallel, yet the same bytes on any number of threads.
    let chunk = ((1 << 20) / ts).max(1) * ts;
    let seeds: Vec<u64> = (0..buf.len().div_ceil(chunk))
        .map(|_| rng.next_u64())
        .collect();
    buf.par_chunks_mut(chunk).zip(seeds).for_each(|(c, seed)| {
        fill(c, &mut SplitMix::new(seed));
        tame(ty, c);
    });
    buf
}

/// Overwrite the scale fields of the whole blocks in `buf` with finite, moderate values.
fn tame(ty: GgmlType, buf: &mut [u8]) {
    let ts = ty.type_size();
    use GgmlType as T;
    match ty {
        _ if !ty.can_dequantize() => {}
        T::F32 => tame_floats::<4>(buf, 23, 0xff, 127),
        T::F16 => tame_floats::<2>(buf, 10, 0x1f, 15),
        T::BF16 => tame_floats::<2>(buf, 7, 0xff, 127),
        // Every UE4M3 scale byte decodes to a finite value.
        T::NVFP4 => {}
        // E8M0 exponents up to 250 keep 12 · 2^(e - 128) finite.
        T::MXFP4 => buf.chunks_exact_mut(ts).for_each(|b| b[0] %= 251),
        T::IQ1_M => buf.chunks_exact_mut(ts).for_each(|b| {
            let d = tame_f16(iq1_m_scale(b));
            set_iq1_m_scale(b, d);
        }),
        _ => {
            let offsets = f16_scale_offsets(ty);
            for b in buf.chunks_exact_mut(ts) {
                for &at in offsets {
                    let d = tame_f16(u16::from_le_bytes([b[at], b[at + 1]]));
                    b[at..at + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
        }
    }
}

/// Byte offsets of the f16 scale fields (`d`, and `dmin` or `m`) in a block of `ty`.
fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType as T;
    match ty {
        T::Q4_1 | T::Q5_1 | T::Q4_K | T::Q5_K => &[0, 2],
        T::Q2_K => &[80, 82],
        T::Q3_K => &[108],
        T::Q6_K => &[208],
        T::TQ1_0 => &[52],
        T::TQ2_0 => &[64],
        // Q4_0, Q5_0, Q8_0 and the i-quants lead with their `d`.
        _ => &[0],
    }
}

/// The buffer filled with the generator's u64s, little-endian.
fn fill(buf: &mut [u8], rng: &mut SplitMix) {
    let mut words = buf.chunks_exact_mut(8);
    for w in &mut words {
        w.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let tail = words.into_remainder();
    let last = rng.next_u64().to_le_bytes();
    tail.copy_from_slice(&last[..tail.len()]);
}

/// Random f16 bits made a moderate scale: the random exponent folded into 2^-14..2^6, sign and
/// mantissa kept, and the two largest exponents (1 in 16) made a signed zero.
fn tame_f16(h: u16) -> u16 {
    let e = (h >> 10) & 0x1f;
    if e >= 30 {
        return h & 0x8000;
    }
    (h & 0x83ff) | ((1 + e % 21) << 10)
}

/// Random `W`-byte floats with the exponent field at `shift` (`mask` wide, bias `bias`) set to a
/// random power in 2^-8..2^8: finite, and far from overflow when multiplied.
fn tame_floats<const W: usize>(buf: &mut [u8], shift: u32, mask: u32, bias: u32) {
    for lane in buf.chunks_exact_mut(W) {
        let mut le = [0u8; 4];
        le[..W].copy_from_slice(lane);
        let v = u32::from_le_bytes(le);
        let e = bias - 8 + ((v >> shift) & 15);
        let v = (v & !(mask << shift)) | (e << shift);
        lane.copy_from_slice(&v.to_le_bytes()[..W]);
    }
}

/// IQ1_M's f16 `d`, whose four nibbles are the top nibbles of the u16s at bytes 48, 50, 52, 54
/// (lowest nibble first).
const IQ1_M_D_WORDS: [usize; 4] = [48, 50, 52, 54];

fn iq1_m_scale(b: &[u8]) -> u16 {
    IQ1_M_D_WORDS
        .iter()
        .enumerate()
        .fold(0, |d, (i, &at)| d | (u16::from(b[at + 1] >> 4) << (4 * i)))
}

fn set_iq1_m_scale(b: &mut [u8], d: u16) {
    for (i, &at) in IQ1_M_D_WORDS.iter().enumerate() {
        let nibble = ((d >> (4 * i)) & 0xf) as u8;
        b[at + 1] = (b[at + 1] & 0x0f) | (nibble << 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::quant::dequantize;

    #[test]
    fn every_dequantizable_type_decodes_finite() {
        for ty in GgmlType::all() {
            if !ty.can_dequantize() {
                continue;
            }
            let blocks = random_blocks(ty, 2048, &mut SplitMix::new(ty.id().into()));
            let mut out = vec![0f32; 2048 * ty.block_size()];
            assert_eq!(dequantize(ty, &blocks, &mut out), Ok(()), "{ty}");
            assert!(
                out.iter().all(|v| v.is_finite()),
                "{ty} has a non-finite value"
            );
            assert!(out.iter().any(|&v| v != 0.0), "{ty} is all zero");
        }
    }

    #[test]
    fn same_blocks_on_one_and_two_threads() {
        // 3.4 MB: several chunks.
        let on = |threads: usize| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("thread pool")
                .install(|| random_blocks(GgmlType::Q8_0, 100_000, &mut SplitMix::new(9)))
        };
        assert!(on(1) == on(2));
    }

    #[test]
    fn same_generator_same_blocks() {
        let a = random_blocks(GgmlType::Q4_K, 7, &mut SplitMix::new(3));
        assert_eq!(a, random_blocks(GgmlType::Q4_K, 7, &mut SplitMix::new(3)));
        assert_ne!(a, random_blocks(GgmlType::Q4_K, 7, &mut SplitMix::new(4)));
    }

    #[test]
    fn tamed_f16_scales_are_moderate() {
        for h in 0..=u16::MAX {
            let v = half::f16::from_bits(tame_f16(h)).to_f32().abs();
            assert!(v == 0.0 || (2f32.powi(-14)..128.0).contains(&v), "{h:#x}");
        }
    }
}
