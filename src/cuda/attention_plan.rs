//! Which keys the tiled attention kernel loads for each tile of query positions, and which of
//! them each query may see.
//!
//! One block per query position and head reads every key and value row its position sees: at
//! 512 prompt positions that is every head's cache read 512 times over. Neighbouring positions
//! see mostly the same keys (all earlier positions, or DSA selections that overlap), so a block
//! that takes [`QUERY_TILE`] positions loads the union of their keys once and masks, per
//! position, the keys it does not see. The plan is one `u32` buffer (`kernels/ops.cu`,
//! `attention_tiled`):
//!
//! * `plan[tile]`, for `tile` in `0..=tiles`: where the tile's keys start in `plan` (the next
//!   tile's start ends them);
//! * `plan[tiles + 1 + tile]`, for `tile` in `0..tiles`: where the tile's mask starts: one row
//!   of `⌈keys / 32⌉` words per query of the tile, bit `s % 32` of word `s / 32` set where the
//!   query sees the tile's key `s`;
//! * then every tile's keys (ascending cache positions), then every tile's mask.

use rayon::prelude::*;

/// Query positions per block of the tiled kernel (`QUERY_TILE` in `kernels/ops.cu`).
pub const QUERY_TILE: usize = 8;

/// The plan for queries whose visible keys are `keys` (−1: an empty slot; every key already
/// checked to be a cached position), or `None` where a tile's key rows would not serve two of
/// its queries each on average (a single position generated, DSA selections that share little):
/// the tiled kernel reads each key row twice (for the maximum, then for the sum), so the
/// per-query kernel reads less there.
pub fn tiled_plan(keys: &[Vec<i32>]) -> Option<Vec<u32>> {
    let tiles = keys.len().div_ceil(QUERY_TILE);
    let seen: usize = keys
        .iter()
        .map(|k| k.iter().filter(|&&j| j >= 0).count())
        .sum();
    // Tiles in parallel: a 512-position prompt is 64 tiles of up to 512 keys.
    let parts: Vec<Tile> = keys.par_chunks(QUERY_TILE).map(Tile::of).collect();
    let loaded: usize = parts.iter().map(|p| p.keys.len()).sum();
    if tiles == 0 || 2 * loaded > seen {
        return None;
    }
    let masks: usize = parts.iter().map(|p| p.mask.len()).sum();
    let mut plan = Vec::with_capacity(2 * tiles + 1 + loaded + masks);
    let mut at = (2 * tiles + 1) as u32;
    for p in &parts {
        plan.push(at);
        at += p.keys.len() as u32;
    }
    plan.push(at);
    for p in &parts {
        plan.push(at);
        at += p.mask.len() as u32;
    }
    for p in &parts {
        plan.extend_from_slice(&p.keys);
    }
    for p in &parts {
        plan.extend_from_slice(&p.mask);
    }
    Some(plan)
}

/// One tile's part of the plan.
struct Tile {
    /// The distinct keys of the tile's queries, ascending.
    keys: Vec<u32>,
    /// [`QUERY_TILE`] rows of `⌈keys / 32⌉` words: bit `s` of a row set where its query sees
    /// key `s` (rows past the last query empty).
    mask: Vec<u32>,
}

impl Tile {
    fn of(queries: &[Vec<i32>]) -> Tile {
        let visible = || {
            queries
                .iter()
                .flatten()
                .filter(|&&j| j >= 0)
                .map(|&j| j as usize)
        };
        let Some(top) = visible().max() else {
            return Tile {
                keys: Vec::new(),
                mask: Vec::new(),
            };
        };
        // Each position's place among the tile's keys (`u32::MAX`: no query sees it), the
        // positions marked first and numbered in order after.
        let mut place = vec![u32::MAX; top + 1];
        visible().for_each(|j| place[j] = 0);
        let mut keys = Vec::new();
        for (j, p) in place.iter_mut().enumerate().filter(|(_, p)| **p == 0) {
            *p = keys.len() as u32;
            keys.push(j as u32);
        }
        let words = keys.len().div_ceil(32);
        let mut mask = vec![0u32; QUERY_TILE * words];
        for (row, query) in mask.chunks_mut(words.max(1)).zip(queries) {
            for &j in query.iter().filter(|&&j| j >= 0) {
                let s = place[j as usize] as usize;
                row[s / 32] |= 1 << (s % 32);
            }
        }
        Tile { keys, mask }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys query `row` of `tile` sees, read back from the plan as the kernel reads it.
    fn seen_by(plan: &[u32], tiles: usize, tile: usize, row: usize) -> Vec<u32> {
        let (first, end) = (plan[tile] as usize, plan[tile + 1] as usize);
        let words = (end - first).div_ceil(32);
        let mask = &plan[plan[tiles + 1 + tile] as usize + row * words..][..words];
        (0..end - first)
            .filter(|s| mask[s / 32] >> (s % 32) & 1 == 1)
            .map(|s| plan[first + s])
            .collect()
    }

    #[test]
    fn every_query_sees_its_own_keys_and_no_other() {
        // 19 causal positions after 40 cached ones (three tiles, the last partial), keys listed
        // in a scrambled order as a top-k lists them, with empty slots.
        let keys: Vec<Vec<i32>> = (0..19)
            .map(|i| {
                let mut k: Vec<i32> = (0..=40 + i).rev().collect();
                let pick = (i as usize * 7) % k.len();
                k.swap(0, pick);
                k.extend([-1, -1]);
                k
            })
            .collect();
        let plan = tiled_plan(&keys).expect("causal tiles share their keys");
        let tiles = 3;
        for (i, want) in keys.iter().enumerate() {
            let mut want: Vec<u32> = want
                .iter()
                .filter(|&&j| j >= 0)
                .map(|&j| j as u32)
                .collect();
            want.sort_unstable();
            assert_eq!(
                seen_by(&plan, tiles, i / QUERY_TILE, i % QUERY_TILE),
                want,
                "query {i}"
            );
        }
        // The padding rows of the last tile see nothing; each tile loads its union once.
        for row in 3..QUERY_TILE {
            assert!(seen_by(&plan, tiles, 2, row).is_empty());
        }
        assert_eq!(plan[1] - plan[0], 48, "tile 0: positions 0..=47");
        assert_eq!(plan[3] - plan[2], 59, "tile 2: positions 0..=58");
    }

    #[test]
    fn a_repeated_key_is_seen_once() {
        let plan = tiled_plan(&[vec![3, 1, 3], vec![1]]).unwrap();
        assert_eq!(seen_by(&plan, 1, 0, 0), [1, 3]);
        assert_eq!(seen_by(&plan, 1, 0, 1), [1]);
    }

    #[test]
    fn selections_that_share_little_keep_the_per_query_kernel() {
        // Each query sees keys of its own: a tile would load as many rows as all its queries
        // together.
        let disjoint: Vec<Vec<i32>> = (0..8).map(|i| vec![2 * i, 2 * i + 1]).collect();
        assert_eq!(tiled_plan(&disjoint), None);
        assert_eq!(tiled_plan(&[]), None);
        // One position generated: its tile serves one query.
        assert_eq!(tiled_plan(&[vec![0, 1, 2]]), None);
        // Two queries sharing every key: each row serves both.
        assert!(tiled_plan(&[vec![0, 1, 2], vec![2, 1, 0]]).is_some());
    }
}
