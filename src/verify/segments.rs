//! One unit of a candidate tensor against the reference, segment by segment.
//!
//! A segment is 256 consecutive stored values (whole blocks of every GGML type). For each one
//! the reference's values are stored in the candidate's type again with ggml's own quantizer:
//! where the candidate's bytes are those bytes the segment is `exact`; else its departure from
//! the reference (Σ(x−c)²) is judged against what that storage leaves of the reference
//! (Σ(x−q)²) — a quantizer with other choices (an importance matrix, another rounding) departs
//! by about as much, a corrupted segment by far more.

use rayon::prelude::*;

use crate::synth::quantize::{has_quantizer, quantize};
use crate::weights::quant::dequantize_rows;
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

/// Sums over some values of both sides.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sums {
    /// Σx² (reference), Σc² (candidate), Σxc, Σ(x−c)², Σ(x−q)² (reference re-stored), and
    /// Σqc, Σq² (for a factor between the candidate and the re-stored reference).
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
    /// The candidate's values there are all zero.
    pub zeros: bool,
}

/// Segments past the band kept as evidence per unit.
const BEYOND_KEPT: usize = 16;

/// What one unit shows.
#[derive(Clone, Debug, Default)]
pub struct UnitStats {
    pub sums: Sums,
    /// Over the segments past the band only.
    pub beyond_sums: Sums,
    pub blocks: u64,
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
    let requant = match ty {
        Some(ty) => restore(ty, row_len, x)?,
        None => None,
    };
    let (q, q_bytes) = match &requant {
        Some((q, b)) => (Some(q.as_slice()), Some(b.as_slice())),
        None => (None, None),
    };
    let (block, type_size) = ty.map_or((1, 1), |t| (t.block_size(), t.type_size()));
    let block_bytes = type_size * SEGMENT / block;
    let per_segment: Vec<(Sums, u64, bool, u64, Option<usize>)> = x
        .par_chunks(SEGMENT)
        .enumerate()
        .map(|(i, xs)| {
            let cs = &c[i * SEGMENT..i * SEGMENT + xs.len()];
            let qs = q.map(|q| &q[i * SEGMENT..i * SEGMENT + xs.len()]);
            // Blocks of this segment whose bytes are the re-quantization's.
            let exact = match (q_bytes, stored) {
                (Some(a), Some(b)) => {
                    let r = i * block_bytes..(i * block_bytes + block_bytes).min(a.len());
                    match (a.get(r.clone()), b.get(r)) {
                        (Some(a), Some(b)) => a
                            .chunks(type_size)
                            .zip(b.chunks(type_size))
                            .filter(|(x, y)| x == y)
                            .count() as u64,
                        _ => 0,
                    }
                }
                _ => 0,
            };
            let mut s = Sums::default();
            let mut nonfinite = 0u64;
            let mut first = None;
            let mut zeros = true;
            for (k, (&xv, &cv)) in xs.iter().zip(cs).enumerate() {
                let (xd, cd) = (f64::from(xv), f64::from(cv));
                zeros &= cv == 0.0;
                if !cv.is_finite() && xv.is_finite() {
                    nonfinite += 1;
                    first.get_or_insert(i * SEGMENT + k);
                    continue;
                }
                s.xx += xd * xd;
                s.cc += cd * cd;
                s.xc += xd * cd;
                s.dd += (xd - cd) * (xd - cd);
                if let Some(qs) = qs {
                    let qd = f64::from(qs[k]);
                    s.nn += (xd - qd) * (xd - qd);
                    s.qc += qd * cd;
                    s.qq += qd * qd;
                }
            }
            (s, exact, zeros, nonfinite, first)
        })
        .collect();
    let mut st = UnitStats {
        requantized: requant.is_some(),
        candidate_all_zero: true,
        ..UnitStats::default()
    };
    for (s, exact, zeros, nonfinite, first) in &per_segment {
        st.sums.add(s);
        st.segments += 1;
        st.blocks += (s_len(x.len(), st.segments) / block) as u64;
        st.blocks_exact += exact;
        st.candidate_all_zero &= *zeros;
        st.nonfinite += nonfinite;
        if st.first_nonfinite.is_none() {
            st.first_nonfinite = *first;
        }
    }
    // Without a quantizer, the unit's own median relative departure stands for its noise.
    let typical = if st.requantized {
        st.sums.nn / st.sums.xx.max(f64::MIN_POSITIVE)
    } else {
        median_ratio(&per_segment)
    };
    for (i, (s, exact, zeros, nonfinite, _)) in per_segment.iter().enumerate() {
        let noise = if st.requantized { s.nn } else { typical * s.xx };
        let allowed = BAND * noise.max(NOISE_FLOOR_SHARE * typical * s.xx)
            + F32_FLOOR * s.xx
            + f64::from(f32::MIN_POSITIVE);
        let all_exact = *exact == (s_len(x.len(), i as u64 + 1) / block) as u64;
        st.worst = st.worst.max(s.dd / (allowed / BAND));
        let past = *nonfinite > 0 || s.dd > allowed || (strict && !all_exact);
        if !past {
            continue;
        }
        st.beyond += 1;
        st.beyond_sums.add(s);
        st.beyond_zeros += u64::from(*zeros && s.xx > 0.0);
        if st.first_beyond.len() < BEYOND_KEPT {
            st.first_beyond.push(Beyond {
                at: i * SEGMENT,
                ratio: s.dd / (allowed / BAND),
                zeros: *zeros,
            });
        }
    }
    Ok(st)
}

/// Values in segment `n` (counted from 1) of a unit of `len` values.
fn s_len(len: usize, n: u64) -> usize {
    let start = (n as usize - 1) * SEGMENT;
    len.saturating_sub(start).min(SEGMENT)
}

/// The reference's values stored as `ty` and read back, with those bytes; `None` where
/// glmcheck has no quantizer for `ty`.
pub fn restore(
    ty: GgmlType,
    row_len: usize,
    x: &[f32],
) -> anyhow::Result<Option<(Vec<f32>, Vec<u8>)>> {
    if !has_quantizer(ty) || row_len % ty.block_size() != 0 {
        return Ok(None);
    }
    let bytes = quantize(ty, x, row_len)?;
    let mut q = vec![0f32; x.len()];
    dequantize_rows(ty, &bytes, &mut q, row_len)?;
    Ok(Some((q, bytes)))
}

/// The median over segments of Σ(x−c)²/Σx².
fn median_ratio(per_segment: &[(Sums, u64, bool, u64, Option<usize>)]) -> f64 {
    let mut r: Vec<f64> = per_segment
        .iter()
        .filter(|(s, ..)| s.xx > 0.0)
        .map(|(s, ..)| s.dd / s.xx)
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
    use crate::synth::SplitMix;

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
