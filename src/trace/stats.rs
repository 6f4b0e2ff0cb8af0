//! The summary every recorded stage carries, full tensor or not: enough to see where values go
//! wrong (NaN, Inf, a blown-up scale, a tensor of zeros) and a content hash to see where two
//! runs stop agreeing bit for bit.
//!
//! Sums run over fixed 64 Ki-element chunks whose partial results are combined in chunk order, so
//! the numbers do not depend on the thread count. The mean and standard deviation take two
//! passes (mean first, then squared deviations), which stays exact where `E[x²] − mean²` would
//! cancel.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Elements per parallel task; also the unit of the fixed summation order.
const TASK: usize = 1 << 16;

/// Bytes per piece of a stage's content hash ([`content_hash`]).
pub const HASH_PIECE_BYTES: usize = 1 << 20;

/// FNV-1a 64-bit offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

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
}

/// An element type the stats are taken over.
pub trait Element: Copy + Send + Sync {
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
        let (stats, hash) = rayon::join(|| moments(xs), || content_hash(xs));
        TensorStats { hash, ..stats }
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
        }
    }
}

/// A stage's content hash: FNV-1a 64 over the little-endian bytes of `xs` when they fit in one
/// piece of [`HASH_PIECE_BYTES`]; past that, FNV-1a 64 over the pieces' own FNV-1a 64 hashes
/// (8 little-endian bytes each, in order). FNV-1a takes one multiply per byte in sequence, under
/// a GB/s on one core: a 512-token layer of GLM-5's width records some 200 MB of stages, which
/// pieces hash on every core. A stage of one piece hashes as plain FNV-1a.
pub fn content_hash<T: Element>(xs: &[T]) -> u64 {
    let per_piece = HASH_PIECE_BYTES / std::mem::size_of::<T>().max(1);
    if xs.len() <= per_piece {
        return fnv1a(xs);
    }
    let pieces: Vec<[u8; 8]> = xs
        .par_chunks(per_piece)
        .map(|piece| fnv1a(piece).to_le_bytes())
        .collect();
    fnv1a_pieces(pieces.iter().map(|h| h.as_slice()))
}

/// FNV-1a 64 over the little-endian bytes of `xs`.
pub fn fnv1a<T: Element>(xs: &[T]) -> u64 {
    xs.iter()
        .flat_map(|x| x.le_bytes())
        .fold(FNV_OFFSET, fnv_step)
}

/// FNV-1a 64 over raw bytes.
pub fn fnv1a_bytes(bytes: &[u8]) -> u64 {
    fnv1a_pieces([bytes])
}

/// FNV-1a 64 over pieces of bytes, as over their concatenation, without making it.
pub fn fnv1a_pieces<'a>(pieces: impl IntoIterator<Item = &'a [u8]>) -> u64 {
    pieces
        .into_iter()
        .flat_map(|p| p.iter().copied())
        .fold(FNV_OFFSET, fnv_step)
}

fn fnv_step(h: u64, b: u8) -> u64 {
    (h ^ u64::from(b)).wrapping_mul(FNV_PRIME)
}

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
    fn of<T: Element>(xs: &[T]) -> Sums {
        let mut s = Sums {
            finite: 0,
            nan: 0,
            inf: 0,
            zeros: 0,
            sum: 0.0,
            sum_sq: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        };
        for v in xs.iter().map(|x| x.value()) {
            if v.is_nan() {
                s.nan += 1;
            } else if v.is_infinite() {
                s.inf += 1;
            } else {
                s.finite += 1;
                s.zeros += u64::from(v == 0.0);
                s.sum += v;
                s.sum_sq += v * v;
                s.min = s.min.min(v);
                s.max = s.max.max(v);
            }
        }
        s
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

/// Every statistic but the hash (left 0).
fn moments<T: Element>(xs: &[T]) -> TensorStats {
    // Collecting keeps chunk order, so the fold below adds in the same order on any pool.
    let parts: Vec<Sums> = xs.par_chunks(TASK).map(Sums::of).collect();
    let Some(s) = parts.into_iter().reduce(Sums::merge) else {
        return TensorStats::of_nothing(0);
    };
    if s.finite == 0 {
        return TensorStats {
            nan: s.nan,
            inf: s.inf,
            ..TensorStats::of_nothing(xs.len() as u64)
        };
    }
    let n = s.finite as f64;
    let mean = s.sum / n;
    let deviation: Vec<f64> = xs
        .par_chunks(TASK)
        .map(|c| {
            c.iter()
                .map(|x| x.value())
                .filter(|v| v.is_finite())
                .map(|v| (v - mean) * (v - mean))
                .sum()
        })
        .collect();
    TensorStats {
        count: xs.len() as u64,
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
    }
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
    use super::*;

    /// One piece hashes as plain FNV-1a; more hash their pieces' hashes in order, the last piece
    /// short.
    #[test]
    fn a_stage_past_one_piece_hashes_its_pieces_hashes() {
        let per = HASH_PIECE_BYTES / 4;
        let xs: Vec<f32> = (0..2 * per + 3).map(|i| i as f32 * 0.5 - 7.0).collect();
        assert_eq!(content_hash(&xs[..per]), fnv1a(&xs[..per]));
        let pieces: Vec<u8> = [&xs[..per], &xs[per..2 * per], &xs[2 * per..]]
            .iter()
            .flat_map(|p| fnv1a(p).to_le_bytes())
            .collect();
        assert_eq!(content_hash(&xs), fnv1a_bytes(&pieces));
        assert_ne!(content_hash(&xs), fnv1a(&xs));
    }
}
