//! One unit of a candidate tensor against the reference, segment by segment.
//!
//! A segment is 256 consecutive stored values (whole blocks of every GGML type). Every segment's
//! departure from the reference (Σ(x−c)²) is measured; the reference's values of a segment are
//! stored in the candidate's type again with ggml's own quantizer (re-quantized) where that
//! can decide something: where the candidate's bytes are those bytes the segment is `exact`,
//! else its departure is judged against what that storage leaves of the reference (Σ(x−q)²) —
//! a quantizer with other choices (an importance matrix, another rounding) departs by about as
//! much, a corrupted segment by far more.
//!
//! Re-quantizing is ggml's scale search, about a hundred times the cost of reading a value, so
//! it runs where it matters: on a fixed pseudo-random sample of the segments (which measures the
//! unit's typical noise, the factor and exactness), on every segment whose departure is past
//! what that typical noise lets through whatever its own noise is, and on every segment with
//! `strict` (`--exact`) or in a small unit. A segment left out departs by at most
//! [`BAND`] × `NOISE_FLOOR_SHARE` of the typical noise, which passes under the rule whatever
//! its own re-quantization would show: the rule is the one re-quantizing everything applies,
//! with the unit's typical noise measured on the sample.

use rayon::prelude::*;

use crate::weights::quant::dequantize_rows;
use crate::weights::quantize::{has_quantizer, quantize, quantize_blocks};
use crate::weights::GgmlType;

/// Values per segment: a multiple of every GGML block size.
pub const SEGMENT: usize = 256;

/// How far past its own storage noise a segment may depart before it is a fault.
pub const BAND: f64 = 8.0;

/// A segment's noise is never taken below this share of its unit's typical relative noise (a
/// segment that happens to quantize almost exactly is no tighter test of another quantizer).
const NOISE_FLOOR_SHARE: f64 = 0.25;

/// The relative error of f32 arithmetic on the way (converters that compute in f64 and round).
const F32_FLOOR: f64 = 1e-12;

/// One segment in this many is in the re-quantized sample.
const SAMPLE_ONE_IN: u64 = 32;

/// Units of at most this many segments are re-quantized whole (a sample would be too few).
const WHOLE_UNIT_SEGMENTS: usize = 256;

/// Sums over some values of both sides.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sums {
    /// Σx² (reference), Σc² (candidate), Σxc, Σ(x−c)², Σ(x−q)² (reference re-stored), and
    /// Σqc, Σq² (for a factor between the candidate and the re-stored reference). The last
    /// three cover the re-quantized segments only.
    pub xx: f64,
    pub cc: f64,
    pub xc: f64,
    pub dd: f64,
    pub nn: f64,
    pub qc: f64,
    pub qq: f64,
}

impl Sums {
    pub fn add(&mut self, o: &Sums) {
        self.xx += o.xx;
        self.cc += o.cc;
        self.xc += o.xc;
        self.dd += o.dd;
        self.nn += o.nn;
        self.qc += o.qc;
        self.qq += o.qq;
    }

    /// 1 − 2Σxc/Σ(x²+c²): 0 for equal values, 1 for unrelated ones.
    pub fn rel_diff(&self) -> f64 {
        rel(self.dd, self.xx + self.cc)
    }

    /// The same measure between the reference and its re-stored values.
    pub fn noise(&self) -> f64 {
        rel(self.nn, 2.0 * self.xx)
    }
}

fn rel(num: f64, den: f64) -> f64 {
    if den > 0.0 {
        num / den
    } else if num > 0.0 {
        1.0
    } else {
        0.0
    }
}

/// A segment past the band, as evidence.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Beyond {
    /// First value's index in the unit.
    pub at: usize,
    /// Σ(x−c)² over the Σ(x−q)² allowed there (how far past its noise).
    pub ratio: f64,
}

/// Segments past the band kept as evidence per unit.
const BEYOND_KEPT: usize = 16;

/// What one unit shows.
#[derive(Clone, Debug, Default)]
pub struct UnitStats {
    pub sums: Sums,
    /// Over the re-quantized sample only: the unit's typical noise and factor.
    pub sample: Sums,
    /// Over the segments past the band only.
    pub beyond_sums: Sums,
    pub blocks: u64,
    /// Blocks re-quantized, and of those the ones whose bytes are the re-quantization's.
    pub blocks_requantized: u64,
    pub blocks_exact: u64,
    pub segments: u64,
    pub beyond: u64,
    /// Segments past the band whose candidate values are all zero.
    pub beyond_zeros: u64,
    /// The first few segments past the band.
    pub first_beyond: Vec<Beyond>,
    /// NaN or ±Inf in the candidate where the reference is finite, and the first one's index.
    pub nonfinite: u64,
    pub first_nonfinite: Option<usize>,
    pub candidate_all_zero: bool,
    /// Whether the noise came from a re-quantization (else from the unit's own spread).
    pub requantized: bool,
    /// The largest departure of any segment over the noise allowed it (past [`BAND`]: a fault).
    pub worst: f64,
}

/// One segment's measures.
#[derive(Clone, Copy, Debug, Default)]
struct Segment {
    sums: Sums,
    /// Blocks, and of those (when re-quantized) the ones with the re-quantization's bytes.
    blocks: u64,
    exact: u64,
    requantized: bool,
    in_sample: bool,
    zeros: bool,
    nonfinite: u64,
    first_nonfinite: Option<usize>,
}

/// Compare one unit: `x` the reference's values in the candidate's layout, `c` the candidate's,
/// `stored` the candidate's bytes (GGML type `ty`, rows of `row_len`; `None` for an encoding
/// that is no GGML type, FP8), `strict`: every block must be the re-quantization's bytes.
pub fn compare(
    ty: Option<GgmlType>,
    row_len: usize,
    x: &[f32],
    c: &[f32],
    stored: Option<&[u8]>,
    strict: bool,
) -> anyhow::Result<UnitStats> {
    judge(ty, row_len, x, c, stored, strict, strict)
}

/// [`compare`], re-quantizing every segment when `whole`.
fn judge(
    ty: Option<GgmlType>,
    row_len: usize,
    x: &[f32],
    c: &[f32],
    stored: Option<&[u8]>,
    strict: bool,
    whole: bool,
) -> anyhow::Result<UnitStats> {
    let block = ty.map_or(1, |t| t.block_size());
    let mut segs: Vec<Segment> = x
        .par_chunks(SEGMENT)
        .zip(c.par_chunks(SEGMENT))
        .enumerate()
        .map(|(i, (xs, cs))| measure(i, xs, cs, block))
        .collect();
    let requant = ty.filter(|&t| has_quantizer(t) && row_len.is_multiple_of(t.block_size()));
    let typical = match requant {
        Some(ty) => {
            let whole = whole || segs.len() <= WHOLE_UNIT_SEGMENTS;
            requantize_where(ty, x, c, stored, &mut segs, |i, _| {
                whole || in_sample(i as u64)
            })?;
            for s in segs.iter_mut().filter(|s| s.requantized) {
                s.in_sample = true;
            }
            let sample = sum_of(segs.iter().filter(|s| s.in_sample));
            let typical = sample.nn / sample.xx.max(f64::MIN_POSITIVE);
            // Past what the floor lets through: the verdict needs the segment's own noise.
            requantize_where(ty, x, c, stored, &mut segs, |_, s| {
                s.nonfinite > 0 || s.sums.dd > BAND * NOISE_FLOOR_SHARE * typical * s.sums.xx
            })?;
            typical
        }
        // Without a quantizer, the unit's own median relative departure stands for its noise.
        None => median_ratio(&segs),
    };
    let mut st = UnitStats {
        requantized: requant.is_some(),
        candidate_all_zero: true,
        sample: sum_of(segs.iter().filter(|s| s.in_sample)),
        ..UnitStats::default()
    };
    for (i, s) in segs.iter().enumerate() {
        st.sums.add(&s.sums);
        st.segments += 1;
        st.blocks += s.blocks;
        st.blocks_exact += s.exact;
        st.blocks_requantized += if s.requantized { s.blocks } else { 0 };
        st.candidate_all_zero &= s.zeros;
        st.nonfinite += s.nonfinite;
        if st.first_nonfinite.is_none() {
            st.first_nonfinite = s.first_nonfinite;
        }
        let own = if s.requantized {
            s.sums.nn
        } else {
            typical * s.sums.xx
        };
        let allowed = BAND * own.max(NOISE_FLOOR_SHARE * typical * s.sums.xx)
            + F32_FLOOR * s.sums.xx
            + f64::from(f32::MIN_POSITIVE);
        st.worst = st.worst.max(s.sums.dd / (allowed / BAND));
        let past = s.nonfinite > 0 || s.sums.dd > allowed || (strict && s.exact < s.blocks);
        if !past {
            continue;
        }
        st.beyond += 1;
        st.beyond_sums.add(&s.sums);
        st.beyond_zeros += u64::from(s.zeros && s.sums.xx > 0.0);
        if st.first_beyond.len() < BEYOND_KEPT {
            st.first_beyond.push(Beyond {
                at: i * SEGMENT,
                ratio: s.sums.dd / (allowed / BAND),
            });
        }
    }
    Ok(st)
}

/// Segment `i`'s sums of both sides (no re-quantization yet).
fn measure(i: usize, xs: &[f32], cs: &[f32], block: usize) -> Segment {
    let mut seg = Segment {
        blocks: (xs.len() / block) as u64,
        ..Segment::default()
    };
    let fast = lane_sums(xs, cs);
    // Finite sums: every value is finite, and Σc² = 0 only where every c is 0.
    if [fast.xx, fast.cc, fast.xc, fast.dd]
        .iter()
        .all(|v| v.is_finite())
    {
        seg.sums = fast;
        seg.zeros = fast.cc == 0.0;
        return seg;
    }
    seg.zeros = cs.iter().all(|&v| v == 0.0);
    let s = &mut seg.sums;
    for (k, (&xv, &cv)) in xs.iter().zip(cs).enumerate() {
        if !cv.is_finite() && xv.is_finite() {
            seg.nonfinite += 1;
            seg.first_nonfinite.get_or_insert(i * SEGMENT + k);
            continue;
        }
        let (xd, cd) = (f64::from(xv), f64::from(cv));
        s.xx += xd * xd;
        s.cc += cd * cd;
        s.xc += xd * cd;
        s.dd += (xd - cd) * (xd - cd);
    }
    seg
}

/// Σx², Σc², Σxc and Σ(x−c)² in independent lanes (one running sum would wait on each
/// addition, and this pass runs over every value of a checkpoint).
fn lane_sums(xs: &[f32], cs: &[f32]) -> Sums {
    const LANES: usize = 4;
    let mut acc = [[0f64; LANES]; 4];
    let mut add = |l: usize, a: f32, b: f32| {
        let (a, b) = (f64::from(a), f64::from(b));
        acc[0][l] += a * a;
        acc[1][l] += b * b;
        acc[2][l] += a * b;
        acc[3][l] += (a - b) * (a - b);
    };
    let mut xk = xs.chunks_exact(LANES);
    let mut ck = cs.chunks_exact(LANES);
    for (x, c) in (&mut xk).zip(&mut ck) {
        for l in 0..LANES {
            add(l, x[l], c[l]);
        }
    }
    for (l, (&a, &b)) in xk.remainder().iter().zip(ck.remainder()).enumerate() {
        add(l, a, b);
    }
    let [xx, cc, xc, dd] = acc.map(|lanes| lanes.iter().sum());
    Sums {
        xx,
        cc,
        xc,
        dd,
        ..Sums::default()
    }
}

/// Whether segment `i` is in the re-quantized sample: a hash of its index, so that no stride
/// lines up with a row's length.
fn in_sample(i: u64) -> bool {
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)).is_multiple_of(SAMPLE_ONE_IN)
}

/// Re-quantize the segments `pick` chooses that are not yet: their noise, factor sums and
/// exact blocks against the candidate's bytes `stored`.
fn requantize_where(
    ty: GgmlType,
    x: &[f32],
    c: &[f32],
    stored: Option<&[u8]>,
    segs: &mut [Segment],
    pick: impl Fn(usize, &Segment) -> bool + Sync,
) -> anyhow::Result<()> {
    let seg_bytes = ty.type_size() * SEGMENT / ty.block_size();
    segs.par_iter_mut()
        .enumerate()
        .filter(|(i, s)| !s.requantized && pick(*i, s))
        .try_for_each(|(i, s)| {
            let r = i * SEGMENT..(i * SEGMENT + SEGMENT).min(x.len());
            let bytes = quantize_blocks(ty, &x[r.clone()])?;
            let mut q = vec![0f32; r.len()];
            dequantize_rows(ty, &bytes, &mut q, r.len())?;
            for ((&xv, &cv), &qv) in x[r.clone()].iter().zip(&c[r]).zip(&q) {
                if !cv.is_finite() && xv.is_finite() {
                    continue;
                }
                let (xd, cd, qd) = (f64::from(xv), f64::from(cv), f64::from(qv));
                s.sums.nn += (xd - qd) * (xd - qd);
                s.sums.qc += qd * cd;
                s.sums.qq += qd * qd;
            }
            let at = i * seg_bytes;
            s.exact = stored
                .and_then(|b| b.get(at..at + bytes.len()))
                .map_or(0, |b| {
                    bytes
                        .chunks(ty.type_size())
                        .zip(b.chunks(ty.type_size()))
                        .filter(|(a, b)| a == b)
                        .count() as u64
                });
            s.requantized = true;
            anyhow::Ok(())
        })
}

fn sum_of<'a>(segs: impl Iterator<Item = &'a Segment>) -> Sums {
    let mut total = Sums::default();
    for s in segs {
        total.add(&s.sums);
    }
    total
}

/// The reference's values stored as `ty` and read back, with those bytes; `None` where
/// glmcheck has no quantizer for `ty`.
pub fn restore(
    ty: GgmlType,
    row_len: usize,
    x: &[f32],
) -> anyhow::Result<Option<(Vec<f32>, Vec<u8>)>> {
    if !has_quantizer(ty) || !row_len.is_multiple_of(ty.block_size()) {
        return Ok(None);
    }
    let bytes = quantize(ty, x, row_len)?;
    let mut q = vec![0f32; x.len()];
    dequantize_rows(ty, &bytes, &mut q, row_len)?;
    Ok(Some((q, bytes)))
}

/// The median over segments of Σ(x−c)²/Σx².
fn median_ratio(segs: &[Segment]) -> f64 {
    let mut r: Vec<f64> = segs
        .iter()
        .filter(|s| s.sums.xx > 0.0)
        .map(|s| s.sums.dd / s.sums.xx)
        .collect();
    if r.is_empty() {
        return 0.0;
    }
    let mid = r.len() / 2;
    *r.select_nth_unstable_by(mid, f64::total_cmp).1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix;

    fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix::new(seed);
        (0..n).map(|_| rng.normal() * 0.02).collect()
    }

    fn stored(ty: GgmlType, x: &[f32]) -> (Vec<f32>, Vec<u8>) {
        restore(ty, 512, x).unwrap().unwrap()
    }

    #[test]
    fn an_honest_quantization_is_exact_and_a_changed_block_is_past_the_band() {
        let x = gaussian(512 * 8, 1);
        let (c, bytes) = stored(GgmlType::Q4_K, &x);
        let st = compare(Some(GgmlType::Q4_K), 512, &x, &c, Some(&bytes), false).unwrap();
        assert_eq!((st.blocks, st.blocks_exact, st.beyond), (16, 16, 0));

        let mut doubled = c.clone();
        doubled[1024..1280].iter_mut().for_each(|v| *v *= 2.0);
        let st = compare(Some(GgmlType::Q4_K), 512, &x, &doubled, None, false).unwrap();
        assert_eq!(st.beyond, 1);
        assert_eq!(st.first_beyond[0].at, 1024);
        assert!(st.first_beyond[0].ratio > 10.0, "{:?}", st.first_beyond);
    }

    #[test]
    fn strict_fails_a_block_within_noise_that_is_not_the_same_bytes() {
        let x = gaussian(512 * 2, 2);
        let (c, mut bytes) = stored(GgmlType::Q8_0, &x);
        // One quant of the first block moves by one step: within noise, not the same bytes.
        bytes[2] = bytes[2].wrapping_add(1);
        let loose = compare(Some(GgmlType::Q8_0), 512, &x, &c, Some(&bytes), false).unwrap();
        let strict = compare(Some(GgmlType::Q8_0), 512, &x, &c, Some(&bytes), true).unwrap();
        assert_eq!((loose.beyond, strict.beyond), (0, 1));
        assert_eq!(loose.blocks_exact, loose.blocks - 1);
    }

    #[test]
    fn a_sample_gives_the_verdict_of_re_quantizing_everything() {
        // 1024 rows of 512: 2048 segments, far past a unit re-quantized whole.
        let x = gaussian(512 * 1024, 4);
        let (honest, bytes) = stored(GgmlType::Q4_K, &x);
        let sampled = compare(Some(GgmlType::Q4_K), 512, &x, &honest, Some(&bytes), false).unwrap();
        assert_eq!((sampled.blocks, sampled.beyond), (2048, 0));
        assert!(
            sampled.blocks_requantized < sampled.blocks / 8,
            "{}",
            sampled.blocks_requantized
        );
        assert_eq!(sampled.blocks_exact, sampled.blocks_requantized);
        // Another quantizer's choices (the reference's values jittered by 1% before storing):
        // within noise everywhere, re-quantizing all or a sample.
        let mut rng = SplitMix::new(5);
        let jittered: Vec<f32> = x.iter().map(|v| v * (1.0 + 0.01 * rng.normal())).collect();
        let (other, _) = stored(GgmlType::Q4_K, &jittered);
        // Faults in segments the sample leaves out: one doubled, one ×1.3, one zeroed.
        let skipped: Vec<usize> = (0..2048)
            .filter(|&i| !in_sample(i as u64))
            .take(3)
            .collect();
        let mut faulty = honest.clone();
        for (k, f) in skipped.iter().zip([2.0f32, 1.3, 0.0]) {
            faulty[k * SEGMENT..(k + 1) * SEGMENT]
                .iter_mut()
                .for_each(|v| *v *= f);
        }
        for (c, beyond) in [(&other, 0), (&faulty, 3)] {
            let full = judge(Some(GgmlType::Q4_K), 512, &x, c, None, false, true).unwrap();
            let part = judge(Some(GgmlType::Q4_K), 512, &x, c, None, false, false).unwrap();
            assert_eq!((full.beyond, part.beyond), (beyond, beyond));
            let at = |st: &UnitStats| st.first_beyond.iter().map(|b| b.at).collect::<Vec<_>>();
            assert_eq!(at(&full), at(&part));
            assert_eq!(full.blocks_requantized, 2048);
            assert!(
                part.blocks_requantized < 2048 / 8 + 3,
                "{}",
                part.blocks_requantized
            );
        }
    }

    #[test]
    fn nan_and_zeros_are_counted() {
        let x = gaussian(512, 3);
        let mut c = x.clone();
        c[300] = f32::NAN;
        c[0..256].iter_mut().for_each(|v| *v = 0.0);
        let st = compare(Some(GgmlType::F32), 512, &x, &c, None, false).unwrap();
        assert_eq!((st.nonfinite, st.first_nonfinite), (1, Some(300)));
        assert_eq!((st.beyond, st.beyond_zeros), (2, 1));
    }
}
