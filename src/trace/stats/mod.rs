//! The summary every recorded stage carries, full tensor or not: enough to see where values go
//! wrong (NaN, Inf, a blown-up scale, a tensor of zeros) and a content hash to see where two
//! runs stop agreeing bit for bit.
//!
//! Sums run over fixed 64 Ki-element chunks whose partial results are combined in chunk order, so
//! the numbers do not depend on the thread count; inside a chunk they run in [`MOMENT_LANES`]
//! lanes (the probes reproduce the order bit for bit). The mean and standard deviation take two
//! passes (mean first, then squared deviations), which stays exact where `E[x²] − mean²` would
//! cancel.

mod hash;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

pub use hash::{
    content_hash, content_hash_of_bytes, content_hash_of_pieces, fnv1a, fnv1a_bytes, fnv1a_pieces,
    lane_hash, merge_lanes, HASH_LANES, HASH_PIECE_BYTES,
};

/// Elements per parallel task; also the unit of the fixed summation order.
pub const TASK: usize = 1 << 16;

/// Statistics started elsewhere (on a GPU, beside the values), finished when called: the
/// caller need not wait for them.
pub type StatsLater = Box<dyn FnOnce() -> anyhow::Result<TensorStats> + Send>;

/// Statistics of one tensor. Moments and extremes are over the finite values; with none, they
/// are all 0.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorStats {
    pub count: u64,
    pub mean: f64,
    /// Population standard deviation (numpy's `std` with `ddof=0`).
    pub std: f64,
    pub min: f64,
    pub max: f64,
    pub absmax: f64,
    /// Euclidean norm.
    pub l2: f64,
    pub nan: u64,
    pub inf: u64,
    /// Elements equal to zero (either sign).
    pub zeros: u64,
    /// [`content_hash`] of the elements' little-endian bytes in order (f32 or f64 bit patterns,
    /// or i32), written as 16 hex digits: JSON readers keep only 53 bits of a number.
    #[serde(with = "hex64")]
    pub hash: u64,
    /// [`sketch`]: the finite values projected onto [`SKETCH_BUCKETS`] fixed random sign
    /// patterns, which a permutation, a rotation or a sign flip moves while every moment above
    /// stays. Absent from older traces and GPU-side statistics.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sketch: Vec<f64>,
}

/// An element type the stats are taken over.
pub trait Element: bytemuck::Pod + Send + Sync {
    /// The value as f64; NaN and ±Inf stay so.
    fn value(self) -> f64;
    /// The bytes the hash reads.
    type Bytes: IntoIterator<Item = u8>;
    fn le_bytes(self) -> Self::Bytes;
}

impl Element for f32 {
    fn value(self) -> f64 {
        f64::from(self)
    }
    type Bytes = [u8; 4];
    fn le_bytes(self) -> [u8; 4] {
        self.to_le_bytes()
    }
}

impl Element for f64 {
    fn value(self) -> f64 {
        self
    }
    type Bytes = [u8; 8];
    fn le_bytes(self) -> [u8; 8] {
        self.to_le_bytes()
    }
}

impl Element for i32 {
    fn value(self) -> f64 {
        f64::from(self)
    }
    type Bytes = [u8; 4];
    fn le_bytes(self) -> [u8; 4] {
        self.to_le_bytes()
    }
}

impl TensorStats {
    /// The statistics and hash of `xs` (f32 values or i32 ids).
    pub fn of<T: Element>(xs: &[T]) -> TensorStats {
        let ((stats, hash), sketch) = rayon::join(
            || rayon::join(|| moments(xs), || content_hash(xs)),
            || sketch(xs),
        );
        TensorStats {
            hash,
            sketch,
            ..stats
        }
    }

    /// `rel_diff` of two stages' sketches, which estimates the values' own `rel_diff`
    /// (Σ(x−y)² / Σ(x²+y²)): each bucket sums its values with random signs, so a bucket's
    /// square is on average its values' sum of squares; `None` unless both have one.
    pub fn sketch_rel_diff(&self, other: &TensorStats) -> Option<f64> {
        let (a, b) = (&self.sketch, &other.sketch);
        if a.is_empty() || a.len() != b.len() {
            return None;
        }
        let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f64 = a.iter().zip(b).map(|(x, y)| x * x + y * y).sum();
        Some(if den > 0.0 { num / den } else { 0.0 })
    }

    /// `count` elements none of which is finite: all moments 0.
    fn of_nothing(count: u64) -> TensorStats {
        TensorStats {
            count,
            mean: 0.0,
            std: 0.0,
            min: 0.0,
            max: 0.0,
            absmax: 0.0,
            l2: 0.0,
            nan: 0,
            inf: 0,
            zeros: 0,
            hash: 0,
            sketch: Vec::new(),
        }
    }
}

/// Buckets of a stage's [`sketch`].
pub const SKETCH_BUCKETS: usize = 32;

/// Element `i`'s bucket and sign in a [`sketch`]: SplitMix64's output for `i`, its low bits the
/// bucket, its top bit the sign (1: minus). Every writer computes the same from the index alone.
pub fn sketch_slot(i: u64) -> (usize, bool) {
    let mut z = i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z % SKETCH_BUCKETS as u64) as usize, z >> 63 == 1)
}

/// The finite values of `xs` (as f64), each added with its sign to its bucket
/// ([`sketch_slot`]), in index order within chunks of [`TASK`] values whose buckets are then
/// added in chunk order: the order every writer (numpy's `bincount`, the C++ probe) keeps, so
/// sketches agree bit for bit. Empty for no values.
pub fn sketch<T: Element>(xs: &[T]) -> Vec<f64> {
    if xs.is_empty() {
        return Vec::new();
    }
    let parts: Vec<[f64; SKETCH_BUCKETS]> = xs
        .par_chunks(TASK)
        .enumerate()
        .map(|(c, chunk)| {
            let mut buckets = [0f64; SKETCH_BUCKETS];
            for (i, x) in chunk.iter().enumerate() {
                let v = x.value();
                if v.is_finite() {
                    let (b, minus) = sketch_slot((c * TASK + i) as u64);
                    buckets[b] += if minus { -v } else { v };
                }
            }
            buckets
        })
        .collect();
    merge_sketches(parts.iter().map(|p| p.as_slice()))
}

/// The chunks' bucket sums of a [`sketch`] added bucket by bucket in chunk order (from +0), as
/// every writer merges them.
pub fn merge_sketches<'a>(chunks: impl Iterator<Item = &'a [f64]>) -> Vec<f64> {
    let mut out = vec![0f64; SKETCH_BUCKETS];
    for part in chunks {
        for (o, p) in out.iter_mut().zip(part) {
            *o += p;
        }
    }
    out
}

/// Lanes of the moments' sums: element `i` of a chunk adds to lane `i mod MOMENT_LANES`, each
/// lane in order, then the lanes in order (from lane 0). Independent lanes let a core (and numpy)
/// add side by side; one accumulator made every add wait on the one before (0.6 GB/s of f32 a
/// core for both passes).
pub const MOMENT_LANES: usize = 16;

/// First-pass sums of one chunk.
#[derive(Clone, Copy)]
struct Sums {
    finite: u64,
    nan: u64,
    inf: u64,
    zeros: u64,
    sum: f64,
    sum_sq: f64,
    min: f64,
    max: f64,
}

impl Sums {
    /// The chunk's sums in [`MOMENT_LANES`] lanes, a value that is not finite adding nothing to
    /// them and counted apart; with AVX2 where the CPU has it (the lanes fix the order, so the
    /// sums are the same either way).
    fn of<T: Element>(xs: &[T]) -> Sums {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { Sums::of_avx2(xs) };
        }
        Sums::of_lanes(xs)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn of_avx2<T: Element>(xs: &[T]) -> Sums {
        Sums::of_lanes(xs)
    }

    #[inline(always)]
    fn of_lanes<T: Element>(xs: &[T]) -> Sums {
        let mut lanes = Lanes::EMPTY;
        let blocks = xs.chunks_exact(MOMENT_LANES);
        let tail = blocks.remainder();
        for block in blocks {
            let block: &[T; MOMENT_LANES] = block.try_into().expect("a block of lanes");
            lanes.add_block(block.map(|x| x.value()));
        }
        tail.iter()
            .enumerate()
            .for_each(|(i, x)| lanes.add(i, x.value()));
        Sums::of_finished_lanes(&lanes, xs.len())
    }

    /// The sums of a chunk of `len` values from its lanes, merged in lane order.
    fn of_finished_lanes(lanes: &Lanes, len: usize) -> Sums {
        let (finite, nan) = (lanes.finite.iter().sum(), lanes.nan.iter().sum());
        Sums {
            finite,
            nan,
            inf: len as u64 - finite - nan,
            zeros: lanes.zeros.iter().sum(),
            sum: in_lane_order(&lanes.sum),
            sum_sq: in_lane_order(&lanes.sum_sq),
            min: lanes.min.iter().fold(f64::INFINITY, |a, &b| a.min(b)),
            max: lanes.max.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b)),
        }
    }

    fn merge(self, b: Sums) -> Sums {
        Sums {
            finite: self.finite + b.finite,
            nan: self.nan + b.nan,
            inf: self.inf + b.inf,
            zeros: self.zeros + b.zeros,
            sum: self.sum + b.sum,
            sum_sq: self.sum_sq + b.sum_sq,
            min: self.min.min(b.min),
            max: self.max.max(b.max),
        }
    }
}

/// [`Sums`] lane by lane, before the lanes are merged.
struct Lanes {
    finite: [u64; MOMENT_LANES],
    nan: [u64; MOMENT_LANES],
    zeros: [u64; MOMENT_LANES],
    sum: [f64; MOMENT_LANES],
    sum_sq: [f64; MOMENT_LANES],
    min: [f64; MOMENT_LANES],
    max: [f64; MOMENT_LANES],
}

/// Per lane: values finite, NaN and zero.
pub const LANE_COUNTS: usize = 3;
/// Per lane: the sum, the sum of squares, the least and the largest finite value.
pub const LANE_SUMS: usize = 4;

impl Lanes {
    /// A chunk's lanes as another device left them: `counts` holds [`LANE_COUNTS`] rows of
    /// [`MOMENT_LANES`] values, `sums` [`LANE_SUMS`] rows.
    fn of_rows(counts: &[u64], sums: &[f64]) -> Lanes {
        let row = |xs: &[u64], r: usize| -> [u64; MOMENT_LANES] {
            xs[r * MOMENT_LANES..(r + 1) * MOMENT_LANES]
                .try_into()
                .expect("a row of lanes")
        };
        let row_f = |r: usize| -> [f64; MOMENT_LANES] {
            sums[r * MOMENT_LANES..(r + 1) * MOMENT_LANES]
                .try_into()
                .expect("a row of lanes")
        };
        Lanes {
            finite: row(counts, 0),
            nan: row(counts, 1),
            zeros: row(counts, 2),
            sum: row_f(0),
            sum_sq: row_f(1),
            min: row_f(2),
            max: row_f(3),
        }
    }

    const EMPTY: Lanes = Lanes {
        finite: [0; MOMENT_LANES],
        nan: [0; MOMENT_LANES],
        zeros: [0; MOMENT_LANES],
        sum: [0.0; MOMENT_LANES],
        sum_sq: [0.0; MOMENT_LANES],
        min: [f64::INFINITY; MOMENT_LANES],
        max: [f64::NEG_INFINITY; MOMENT_LANES],
    };

    /// Value `v` into lane `i`. An infinity or NaN adds +0 to the sums, which leaves them as
    /// they are (a sum that starts at +0 is never −0).
    #[inline(always)]
    fn add(&mut self, i: usize, v: f64) {
        let is_finite = v.is_finite();
        let f = if is_finite { v } else { 0.0 };
        self.sum[i] += f;
        self.sum_sq[i] += f * f;
        if is_finite {
            self.min[i] = if v < self.min[i] { v } else { self.min[i] };
            self.max[i] = if v > self.max[i] { v } else { self.max[i] };
        }
        self.finite[i] += u64::from(is_finite);
        self.nan[i] += u64::from(v.is_nan());
        self.zeros[i] += u64::from(v == 0.0);
    }

    /// One value into each lane; when all are finite (the common case), without the masks, so
    /// that the lanes vectorize.
    #[inline(always)]
    fn add_block(&mut self, v: [f64; MOMENT_LANES]) {
        if !v.iter().all(|v| v.is_finite()) {
            v.iter().enumerate().for_each(|(i, &v)| self.add(i, v));
            return;
        }
        #[allow(clippy::needless_range_loop)] // seven arrays indexed in lockstep
        for i in 0..MOMENT_LANES {
            let v = v[i];
            self.sum[i] += v;
            self.sum_sq[i] += v * v;
            self.min[i] = if v < self.min[i] { v } else { self.min[i] };
            self.max[i] = if v > self.max[i] { v } else { self.max[i] };
            self.zeros[i] += u64::from(v == 0.0);
        }
        self.finite[0] += MOMENT_LANES as u64;
    }
}

/// The squared deviations from `mean` of a chunk's finite values, summed in the lanes of
/// [`Sums::of`]; with AVX2 where the CPU has it.
fn squared_deviations<T: Element>(xs: &[T], mean: f64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { squared_deviations_avx2(xs, mean) };
    }
    squared_deviations_in_lanes(xs, mean)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn squared_deviations_avx2<T: Element>(xs: &[T], mean: f64) -> f64 {
    squared_deviations_in_lanes(xs, mean)
}

#[inline(always)]
fn squared_deviations_in_lanes<T: Element>(xs: &[T], mean: f64) -> f64 {
    let mut acc = [0f64; MOMENT_LANES];
    let add = |lanes: &mut [f64], xs: &[T]| {
        for (acc, x) in lanes.iter_mut().zip(xs) {
            let v = x.value();
            let d = v - mean;
            *acc += if v.is_finite() { d * d } else { 0.0 };
        }
    };
    let blocks = xs.chunks_exact(MOMENT_LANES);
    let tail = blocks.remainder();
    blocks.for_each(|block| add(&mut acc, block));
    add(&mut acc, tail);
    in_lane_order(&acc)
}

/// Lanes added one after another, from lane 0.
fn in_lane_order(lanes: &[f64]) -> f64 {
    lanes.iter().fold(0.0, |a, &b| a + b)
}

/// Every statistic but the hash (left 0).
fn moments<T: Element>(xs: &[T]) -> TensorStats {
    // Collecting keeps chunk order, so the fold below adds in the same order on any pool.
    let parts: Vec<Sums> = xs.par_chunks(TASK).map(Sums::of).collect();
    let Ok(stats) = moments_of_parts::<std::convert::Infallible>(xs.len(), parts, |mean| {
        Ok(xs
            .par_chunks(TASK)
            .map(|c| squared_deviations(c, mean))
            .collect())
    });
    stats
}

/// `moments` of `count` values whose chunks of [`TASK`] values were summed lane by lane on
/// another device (a GPU), in this module's order: per chunk, `counts` holds [`LANE_COUNTS`]
/// rows of [`MOMENT_LANES`] values and `sums` [`LANE_SUMS`] rows; `deviations(mean)` gives per
/// chunk its [`MOMENT_LANES`] lanes of squared deviations from the mean. The lanes and chunks
/// are merged here as the host merges its own, so the statistics are the host's bit for bit.
pub fn moments_of_lanes<Err>(
    count: usize,
    counts: &[u64],
    sums: &[f64],
    deviations: impl FnOnce(f64) -> Result<Vec<f64>, Err>,
) -> Result<TensorStats, Err> {
    let chunks = count.div_ceil(TASK);
    let parts = (0..chunks)
        .map(|c| {
            let lanes = Lanes::of_rows(
                &counts[c * LANE_COUNTS * MOMENT_LANES..(c + 1) * LANE_COUNTS * MOMENT_LANES],
                &sums[c * LANE_SUMS * MOMENT_LANES..(c + 1) * LANE_SUMS * MOMENT_LANES],
            );
            Sums::of_finished_lanes(&lanes, TASK.min(count - c * TASK))
        })
        .collect();
    moments_of_parts(count, parts, |mean| {
        Ok(deviations(mean)?
            .chunks(MOMENT_LANES)
            .map(in_lane_order)
            .collect())
    })
}

/// The statistics from each chunk's sums in chunk order; `deviations(mean)` gives each chunk's
/// sum of squared deviations from the mean.
fn moments_of_parts<Err>(
    count: usize,
    parts: Vec<Sums>,
    deviations: impl FnOnce(f64) -> Result<Vec<f64>, Err>,
) -> Result<TensorStats, Err> {
    let Some(s) = parts.into_iter().reduce(Sums::merge) else {
        return Ok(TensorStats::of_nothing(0));
    };
    if s.finite == 0 {
        return Ok(TensorStats {
            nan: s.nan,
            inf: s.inf,
            ..TensorStats::of_nothing(count as u64)
        });
    }
    let n = s.finite as f64;
    let mean = s.sum / n;
    let deviation = deviations(mean)?;
    Ok(TensorStats {
        count: count as u64,
        mean,
        std: (deviation.iter().sum::<f64>() / n).sqrt(),
        min: s.min,
        max: s.max,
        absmax: s.min.abs().max(s.max.abs()),
        l2: s.sum_sq.sqrt(),
        nan: s.nan,
        inf: s.inf,
        zeros: s.zeros,
        hash: 0,
        sketch: Vec::new(),
    })
}

/// `u64` as exactly 16 lowercase hex digits in JSON.
pub(crate) mod hex64 {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:016x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let text = String::deserialize(d)?;
        parse(&text).ok_or_else(|| D::Error::custom(format!("hash `{text}` is not 16 hex digits")))
    }

    /// Exactly 16 hex digits as a `u64`.
    pub fn parse(text: &str) -> Option<u64> {
        let hex = text.len() == 16 && text.bytes().all(|b| b.is_ascii_hexdigit());
        hex.then(|| u64::from_str_radix(text, 16).ok()).flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::hash::{round, P1, P2};
    use super::*;

    /// One piece hashes as its lane hash; more hash their pieces' hashes in order, the last
    /// piece short.
    #[test]
    fn a_stage_past_one_piece_hashes_its_pieces_hashes() {
        let per = HASH_PIECE_BYTES / 4;
        let xs: Vec<f32> = (0..2 * per + 3).map(|i| i as f32 * 0.5 - 7.0).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&xs);
        assert_eq!(content_hash(&xs[..per]), lane_hash(&bytes[..4 * per]));
        let pieces: Vec<u8> = bytes
            .chunks(HASH_PIECE_BYTES)
            .flat_map(|p| lane_hash(p).to_le_bytes())
            .collect();
        assert_eq!(content_hash(&xs), lane_hash(&pieces));
        assert_ne!(content_hash(&xs), lane_hash(bytes));
    }

    #[test]
    fn the_sketch_sees_what_the_moments_cannot() {
        let x: Vec<f32> = (0..3000)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let mut permuted = x.clone();
        permuted.swap(10, 2000);
        permuted.swap(11, 1500);
        let negated: Vec<f32> = x.iter().map(|v| -v).collect();
        let (a, p, n) = (
            TensorStats::of(&x),
            TensorStats::of(&permuted),
            TensorStats::of(&negated),
        );
        assert_eq!((a.l2, a.count), (p.l2, p.count));
        assert_eq!(a.sketch_rel_diff(&a), Some(0.0));
        assert!(a.sketch_rel_diff(&p).unwrap() > 1e-4);
        // A sign flip is the largest departure there is (rel_diff 2).
        assert!((a.sketch_rel_diff(&n).unwrap() - 2.0).abs() < 1e-12);
        // Over many values the estimate follows the true rel_diff.
        let y: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, v)| v + 0.01 * ((i % 7) as f32 - 3.0))
            .collect();
        let est = a.sketch_rel_diff(&TensorStats::of(&y)).unwrap();
        let truth = crate::compare::metrics::Metrics::of(&x, &y).rel_diff;
        assert!(
            est > truth / 4.0 && est < truth * 4.0,
            "{est} against {truth}"
        );
        // Chunks of TASK values add in chunk order: a long tensor is summed as documented.
        let long: Vec<f32> = (0..(TASK + 5)).map(|i| (i % 13) as f32).collect();
        let mut buckets = [0f64; SKETCH_BUCKETS];
        let mut tail = [0f64; SKETCH_BUCKETS];
        for (i, v) in long.iter().enumerate() {
            let (b, minus) = sketch_slot(i as u64);
            let target = if i < TASK { &mut buckets } else { &mut tail };
            target[b] += if minus { -f64::from(*v) } else { f64::from(*v) };
        }
        let want: Vec<f64> = buckets.iter().zip(tail).map(|(a, b)| a + b).collect();
        assert_eq!(sketch(&long), want);
        assert!(sketch::<f32>(&[]).is_empty());
    }

    /// The statistics from lanes summed elsewhere, one lane at a time as a GPU thread sums it
    /// (`stage_*` of `kernels/ops.cu`), equal the host's bit for bit: several chunks and hash
    /// pieces, the last ones partial, an odd count, NaN, ±Inf and zeros of both signs.
    #[test]
    fn lanes_summed_elsewhere_give_the_hosts_statistics() {
        let n = 2 * HASH_PIECE_BYTES / 4 + 3 * TASK / 2 + 7;
        let mut xs: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0)
            .collect();
        for (i, v) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]
            .iter()
            .cycle()
            .take(40)
            .enumerate()
        {
            xs[i * 12_347 % n] = *v;
        }
        let chunks = n.div_ceil(TASK);
        let mut counts = vec![0u64; chunks * LANE_COUNTS * MOMENT_LANES];
        let mut sums = vec![0f64; chunks * LANE_SUMS * MOMENT_LANES];
        for c in 0..chunks {
            for lane in 0..MOMENT_LANES {
                let (mut f, mut nan, mut z) = (0, 0, 0);
                let (mut sum, mut sq, mut lo, mut hi) =
                    (0.0, 0.0, f64::INFINITY, f64::NEG_INFINITY);
                for j in (c * TASK + lane..((c + 1) * TASK).min(n)).step_by(MOMENT_LANES) {
                    let v = f64::from(xs[j]);
                    let fin = v.is_finite();
                    let x = if fin { v } else { 0.0 };
                    sum += x;
                    sq += x * x;
                    if fin {
                        lo = if v < lo { v } else { lo };
                        hi = if v > hi { v } else { hi };
                    }
                    f += u64::from(fin);
                    nan += u64::from(v.is_nan());
                    z += u64::from(v == 0.0);
                }
                let at =
                    |row: usize, width: usize| c * width * MOMENT_LANES + row * MOMENT_LANES + lane;
                for (row, v) in [f, nan, z].into_iter().enumerate() {
                    counts[at(row, LANE_COUNTS)] = v;
                }
                for (row, v) in [sum, sq, lo, hi].into_iter().enumerate() {
                    sums[at(row, LANE_SUMS)] = v;
                }
            }
        }
        let deviations = |mean: f64| -> Result<Vec<f64>, ()> {
            Ok((0..chunks * MOMENT_LANES)
                .map(|id| {
                    let (c, lane) = (id / MOMENT_LANES, id % MOMENT_LANES);
                    (c * TASK + lane..((c + 1) * TASK).min(n))
                        .step_by(MOMENT_LANES)
                        .map(|j| f64::from(xs[j]))
                        .fold(0.0, |acc, v| {
                            acc + if v.is_finite() {
                                (v - mean) * (v - mean)
                            } else {
                                0.0
                            }
                        })
                })
                .collect())
        };
        let elsewhere = moments_of_lanes(n, &counts, &sums, deviations).unwrap();

        let bytes: &[u8] = bytemuck::cast_slice(&xs);
        let pieces: Vec<u64> = bytes
            .chunks(HASH_PIECE_BYTES)
            .map(|piece| {
                let mut lanes = [P1.wrapping_add(P2); HASH_LANES];
                for (w, word) in piece.chunks(8).enumerate() {
                    let mut padded = [0u8; 8];
                    padded[..word.len()].copy_from_slice(word);
                    let lane = &mut lanes[w % HASH_LANES];
                    *lane = round(*lane, u64::from_le_bytes(padded));
                }
                merge_lanes(&lanes, piece.len())
            })
            .collect();
        let hash = content_hash_of_pieces(&pieces, bytes.len());
        let host = TensorStats::of(&xs);
        // The sketch is the host's alone (GPU statistics carry none).
        let sketch = host.sketch.clone();
        assert_eq!(
            TensorStats {
                hash,
                sketch,
                ..elsewhere
            },
            host
        );
        assert!(host.nan > 0 && host.inf > 0 && host.zeros > 0);
    }

    /// A change of one bit anywhere, in any lane, block or the padded tail, changes the hash; so
    /// do two sign flips in one lane (which cancel in a plain xor-multiply chain), a trailing
    /// zero byte, and two words swapped between lanes.
    #[test]
    fn the_lane_hash_sees_every_bit_and_the_length() {
        let bytes: Vec<u8> = (0..8 * HASH_LANES * 2 + 13)
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        let h = lane_hash(&bytes);
        for at in [0, 7, 8, 8 * HASH_LANES - 1, 8 * HASH_LANES, bytes.len() - 1] {
            for bit in [0, 7] {
                let mut b = bytes.clone();
                b[at] ^= 1 << bit;
                assert_ne!(lane_hash(&b), h, "byte {at} bit {bit}");
            }
        }
        let mut signs = bytes.clone();
        signs[7] ^= 0x80;
        signs[8 * HASH_LANES + 7] ^= 0x80;
        assert_ne!(lane_hash(&signs), h);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_ne!(lane_hash(&longer), h);
        let mut swapped = bytes.clone();
        swapped.swap(0, 8);
        assert_ne!(lane_hash(&swapped), h);
        assert_ne!(lane_hash(&[]), lane_hash(&[0]));
    }
}
