//! The content hash every stage carries (lane-parallel over 1 MiB pieces, as the probes
//! reproduce it) and FNV-1a for small keys.

use rayon::prelude::*;

use super::Element;

/// Bytes per piece of a stage's content hash ([`content_hash`]).
pub const HASH_PIECE_BYTES: usize = 1 << 20;

/// FNV-1a 64-bit offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// A stage's content hash: [`lane_hash`] of the values' little-endian bytes when they fit in one
/// piece of [`HASH_PIECE_BYTES`]; past that, [`lane_hash`] of the pieces' own lane hashes (8
/// little-endian bytes each, in order), so that the pieces of a large stage hash on every core.
pub fn content_hash<T: Element>(xs: &[T]) -> u64 {
    content_hash_of_bytes(&little_endian_bytes(xs))
}

/// [`content_hash`] of values given as their little-endian bytes.
pub fn content_hash_of_bytes(bytes: &[u8]) -> u64 {
    if bytes.len() <= HASH_PIECE_BYTES {
        return lane_hash(bytes);
    }
    let pieces: Vec<u64> = bytes.par_chunks(HASH_PIECE_BYTES).map(lane_hash).collect();
    content_hash_of_pieces(&pieces, bytes.len())
}

/// The bytes of `xs` as little-endian: borrowed where the host is little-endian.
fn little_endian_bytes<T: Element>(xs: &[T]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(xs))
    } else {
        std::borrow::Cow::Owned(xs.iter().flat_map(|x| x.le_bytes()).collect())
    }
}

/// Lanes of [`lane_hash`]: independent chains a core (or numpy) advances side by side.
pub const HASH_LANES: usize = 256;

/// xxHash64's primes.
pub(super) const P1: u64 = 0x9E37_79B1_85EB_CA87;
pub(super) const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

/// A 64-bit hash of `bytes` fast on one core and in numpy: the bytes as little-endian u64 words
/// (the last zero-padded), word `i` fed to lane `i mod` [`HASH_LANES`] by xxHash64's round (each
/// lane starts at `P1 + P2`), then the byte count and the lanes in order merged and avalanched as
/// xxHash64 merges its four. Every step is a bijection of the word it takes, so a change confined
/// to one word always changes the hash. Byte-serial FNV-1a, which this replaced, ran one multiply
/// per byte in sequence: under a GB/s.
pub fn lane_hash(bytes: &[u8]) -> u64 {
    let mut lanes = [P1.wrapping_add(P2); HASH_LANES];
    let mut blocks = bytes.chunks_exact(8 * HASH_LANES);
    for block in &mut blocks {
        for (lane, word) in lanes.iter_mut().zip(block.chunks_exact(8)) {
            *lane = round(*lane, u64::from_le_bytes(word.try_into().expect("8 bytes")));
        }
    }
    for (lane, word) in lanes.iter_mut().zip(blocks.remainder().chunks(8)) {
        let mut padded = [0u8; 8];
        padded[..word.len()].copy_from_slice(word);
        *lane = round(*lane, u64::from_le_bytes(padded));
    }
    merge_lanes(&lanes, bytes.len())
}

/// The end of [`lane_hash`] from its lanes as the words left them, for `len` bytes: where the
/// lanes were advanced elsewhere (a GPU), the same hash.
pub fn merge_lanes(lanes: &[u64; HASH_LANES], len: usize) -> u64 {
    let merged = lanes.iter().fold(P5.wrapping_add(len as u64), |h, &lane| {
        (h ^ round(0, lane)).wrapping_mul(P1).wrapping_add(P4)
    });
    avalanche(merged)
}

/// [`content_hash`] of `len` bytes from the [`lane_hash`] of each of their pieces of
/// [`HASH_PIECE_BYTES`], in order.
pub fn content_hash_of_pieces(piece_hashes: &[u64], len: usize) -> u64 {
    if len <= HASH_PIECE_BYTES {
        return piece_hashes
            .first()
            .copied()
            .unwrap_or_else(|| lane_hash(&[]));
    }
    let bytes: Vec<u8> = piece_hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
    lane_hash(&bytes)
}

/// xxHash64's round: a word into an accumulator.
pub(super) fn round(acc: u64, word: u64) -> u64 {
    acc.wrapping_add(word.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

/// xxHash64's final mix: every input bit reaches every output bit.
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
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
