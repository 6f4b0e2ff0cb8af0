//! Large outputs written past the cache: a weight of tens of MB does not stay in any cache level
//! anyway, and ordinary stores make each core read every output line before overwriting it. A
//! block decoder fills a small buffer that stays in L1, and that buffer goes out with
//! non-temporal stores, which on x86 write whole lines without reading them first (2.5–4× the
//! rate of ordinary stores on one core on some hosts, half of it on others: see [`Stores`]).
//! The output may be memory never written: each value is written once, so a new weight needs
//! no zero fill first.

use std::mem::MaybeUninit;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::BlockDecoder;
use crate::weights::GgmlType;

/// Outputs at least this large stream past the cache; smaller ones stay in it for the op that
/// reads them next (a norm, a GEMM).
pub(super) const STREAM_MIN_BYTES: usize = 32 << 20;

/// Values decoded per step into the L1 buffer: 4 KiB. Shorter bursts of streamed stores leave
/// the core less time stalled on them than 16 KiB ones (one core: 3–8% faster on Q4_0, Q6_K and
/// Q8_0, Q4_K the same; 1 KiB steps were slower).
const STEP_VALUES: usize = 1024;

/// `decode` of `src` (whole blocks of `bs` values in `ts` bytes) into `dst`, a step of blocks
/// at a time through an L1 buffer streamed out to `dst`. The values are `decode`'s own; every
/// value of `dst` is written.
pub(super) fn decode_streaming(
    decode: BlockDecoder,
    (bs, ts): (usize, usize),
    src: &[u8],
    dst: &mut [MaybeUninit<f32>],
) {
    decode_with(stores(), decode, (bs, ts), src, dst);
}

/// [`decode_streaming`] with `stores` out of the L1 buffer.
fn decode_with(
    stores: Stores,
    decode: BlockDecoder,
    (bs, ts): (usize, usize),
    src: &[u8],
    dst: &mut [MaybeUninit<f32>],
) {
    let copy = stores.copy();
    let blocks_per_step = (STEP_VALUES / bs).max(1);
    let mut buffer = vec![0f32; blocks_per_step * bs];
    for (s, d) in src
        .chunks(blocks_per_step * ts)
        .zip(dst.chunks_mut(blocks_per_step * bs))
    {
        let decoded = &mut buffer[..d.len()];
        decode(s, decoded);
        copy(decoded, d);
    }
    finish_streams();
}

/// How a large output leaves the L1 buffer. Which is faster depends on the core, not the type:
/// streamed stores wrote 2.5–4× ordinary ones' rate on a Zen 3 EPYC and a Xeon, and half of it
/// on a Zen 4 EPYC (GB/s on one core, `cargo bench --bench dequant`). The values are the same
/// either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stores {
    /// Non-temporal stores, past the cache.
    Streamed,
    /// Ordinary stores, through the cache.
    Ordinary,
}

impl Stores {
    pub fn name(self) -> &'static str {
        match self {
            Stores::Streamed => "streamed",
            Stores::Ordinary => "ordinary",
        }
    }

    fn copy(self) -> fn(&[f32], &mut [MaybeUninit<f32>]) {
        match self {
            Stores::Streamed => copy_past_cache,
            Stores::Ordinary => |src, dst| write_all(dst, src),
        }
    }
}

/// This process's choice for large outputs: `GLMCHECK_STORES` (`streamed` or `ordinary`) where
/// set to one of them, else the faster of the two on this machine, timed once on first use (with
/// a warning on stderr where the variable holds something else).
pub fn stores() -> Stores {
    static CHOICE: OnceLock<Stores> = OnceLock::new();
    *CHOICE.get_or_init(|| match std::env::var("GLMCHECK_STORES") {
        Ok(v) if v == "streamed" => Stores::Streamed,
        Ok(v) if v == "ordinary" => Stores::Ordinary,
        Ok(other) => {
            eprintln!(
                "glmcheck: GLMCHECK_STORES={other:?} is neither `streamed` nor `ordinary`; \
                 timing both instead"
            );
            faster_stores()
        }
        Err(_) => faster_stores(),
    })
}

/// Values the timing writes: 64 MiB, past the last cache level of most hosts, as a weight is.
const PROBE_VALUES: usize = 16 << 20;

/// Rounds of each kind the timing alternates, keeping each kind's best (the host may be shared).
const PROBE_ROUNDS: usize = 3;

/// Streamed or ordinary stores, whichever dequantizes [`PROBE_VALUES`] of Q4_K (the bulk of a
/// Q4_K_M GLM-5) sooner on one core, through the decoder's own path (about 40 ms, once a
/// process). A bare copy out of the L1 buffer misled: on one shared Zen host streamed stores
/// copied faster, yet decoding between them halved the rate they kept (Q4_K 8.5 GB/s against
/// 16.6 with ordinary stores).
fn faster_stores() -> Stores {
    let (bs, ts) = (GgmlType::Q4_K.block_size(), GgmlType::Q4_K.type_size());
    let decode = super::block_decoder(GgmlType::Q4_K).expect("Q4_K decodes on the CPU");
    // Zero blocks decode to zeros with the same instructions as any others.
    let src = vec![0u8; PROBE_VALUES / bs * ts];
    // Ones, not zeros: every page is touched now, not on the first timed round.
    let mut dst = vec![MaybeUninit::new(1f32); PROBE_VALUES];
    let mut time = |stores: Stores| {
        let start = Instant::now();
        decode_with(stores, decode, (bs, ts), &src, &mut dst);
        std::hint::black_box(&dst);
        start.elapsed()
    };
    let (mut streamed, mut ordinary) = (Duration::MAX, Duration::MAX);
    for _ in 0..PROBE_ROUNDS {
        streamed = streamed.min(time(Stores::Streamed));
        ordinary = ordinary.min(time(Stores::Ordinary));
    }
    if streamed < ordinary {
        Stores::Streamed
    } else {
        Stores::Ordinary
    }
}

/// `dst` ← `src`, the 16-byte aligned middle of `dst` with SSE's non-temporal stores (part of
/// x86_64). AVX's 32-byte ones were slower: a vector of f32 is 16-byte aligned but seldom 32, so
/// each step began and ended with ordinary stores into lines that streamed stores also wrote,
/// and a line written both ways stalls the core (Q4_K 13 GB/s on one core against 15).
#[cfg(target_arch = "x86_64")]
fn copy_past_cache(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::{__m128, _mm_loadu_ps, _mm_stream_ps};
    // SAFETY: `MaybeUninit<__m128>` takes any bytes, written or not; the aligned middle is only
    // written, each vector from four values of `src`, which is as long as `dst`.
    let (head, middle, tail) = unsafe { dst.align_to_mut::<MaybeUninit<__m128>>() };
    let (src_head, rest) = src.split_at(head.len());
    let (src_middle, src_tail) = rest.split_at(middle.len() * 4);
    write_all(head, src_head);
    for (to, from) in middle.iter_mut().zip(src_middle.chunks_exact(4)) {
        // SAFETY: `from` holds four values; `to` is aligned and writable.
        unsafe { _mm_stream_ps(to.as_mut_ptr().cast(), _mm_loadu_ps(from.as_ptr())) };
    }
    write_all(tail, src_tail);
}

#[cfg(not(target_arch = "x86_64"))]
fn copy_past_cache(src: &[f32], dst: &mut [MaybeUninit<f32>]) {
    write_all(dst, src);
}

/// `dst` ← `src` with ordinary stores.
fn write_all(dst: &mut [MaybeUninit<f32>], src: &[f32]) {
    dst.iter_mut().zip(src).for_each(|(d, &v)| {
        d.write(v);
    });
}

/// Orders the streamed stores before any later store or read of them, by this thread or one
/// that joins it.
fn finish_streams() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a store fence has no operands.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

#[cfg(test)]
mod tests {
    use super::super::{block_decoder, dequantize, dequantize_rows, dequantize_rows_to_vec};
    use super::*;
    use crate::rng::SplitMix;
    use crate::weights::quantize::random_blocks;
    use crate::weights::GgmlType;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Values written beforehand (a NaN each), so that every one can be read back: one the
    /// streaming missed shows as that NaN.
    fn poisoned(n: usize) -> Vec<MaybeUninit<f32>> {
        vec![MaybeUninit::new(f32::NAN); n]
    }

    fn read(v: &[MaybeUninit<f32>]) -> Vec<u32> {
        // SAFETY: every value was written, by `poisoned` if by nothing else.
        v.iter()
            .map(|x| unsafe { x.assume_init() }.to_bits())
            .collect()
    }

    /// Both kinds of stores write `src` to every value of outputs at every alignment.
    #[test]
    fn both_stores_write_every_value_at_every_alignment() {
        let src: Vec<f32> = (0..STEP_VALUES + 13).map(|i| i as f32 - 0.25).collect();
        for stores in [Stores::Streamed, Stores::Ordinary] {
            for offset in 0..9 {
                let mut out = poisoned(offset + src.len());
                stores.copy()(&src, &mut out[offset..]);
                finish_streams();
                assert_eq!(read(&out[offset..]), bits(&src), "{stores:?} at {offset}");
            }
        }
    }

    /// Through the L1 buffer, into outputs at every alignment, the values
    /// are the decoder's own, bit for bit, and every one is written.
    #[test]
    fn streamed_values_are_the_decoders_at_every_alignment() {
        for ty in [
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
            GgmlType::IQ4_XS,
        ] {
            let (bs, ts) = (ty.block_size(), ty.type_size());
            // Three steps and a partial one.
            let blocks = 3 * STEP_VALUES / bs + 5;
            let src = random_blocks(ty, blocks, &mut SplitMix::new(7));
            let mut plain = vec![0f32; blocks * bs];
            dequantize(ty, &src, &mut plain).unwrap();
            for offset in 0..9 {
                let mut out = poisoned(offset + plain.len());
                decode_streaming(
                    block_decoder(ty).unwrap(),
                    (bs, ts),
                    &src,
                    &mut out[offset..],
                );
                assert_eq!(
                    read(&out[offset..]),
                    bits(&plain),
                    "{ty} at offset {offset}"
                );
            }
        }
    }

    /// An output past the streaming threshold, spread over the pool, into a given buffer or a
    /// new vector, equals the plain decode.
    #[test]
    fn a_large_output_streams_to_the_same_values() {
        let ty = GgmlType::Q4_K;
        let values = STREAM_MIN_BYTES / 4 + 4096;
        let src = random_blocks(ty, values / ty.block_size(), &mut SplitMix::new(11));
        let (mut plain, mut rows) = (vec![0f32; values], vec![0f32; values]);
        dequantize(ty, &src, &mut plain).unwrap();
        dequantize_rows(ty, &src, &mut rows, 4096).unwrap();
        assert!(bits(&plain) == bits(&rows));
        let fresh = dequantize_rows_to_vec(ty, &src, 4096).unwrap();
        assert!(bits(&plain) == bits(&fresh));
    }
}
