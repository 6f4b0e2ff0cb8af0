//! Whole tensors from tensor-parallel parts, by the stage's dims spec (docs/design.md §4): an axis
//! marked `(tp)` (`t h(tp) d`) is concatenated in rank order, `partial(tp)` parts are summed.

use anyhow::{bail, Result};

/// How the ranks' parts of a stage make the whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Concatenated along this axis.
    Split(usize),
    /// Summed element by element.
    Partial,
}

impl Sharding {
    /// Read a dims spec such as `t h(tp) d`, `t v(tp)` or `t d partial(tp)`.
    pub fn of(dims: &str) -> Result<Sharding> {
        let tokens: Vec<&str> = dims.split_whitespace().collect();
        let partial = tokens.iter().filter(|t| **t == "partial(tp)").count();
        let split: Vec<usize> = tokens
            .iter()
            .filter(|t| **t != "partial(tp)")
            .enumerate()
            .filter(|(_, t)| t.ends_with("(tp)"))
            .map(|(i, _)| i)
            .collect();
        match (partial, split.as_slice()) {
            (0, []) => Ok(Sharding::Replicated),
            (0, [axis]) => Ok(Sharding::Split(*axis)),
            (1, []) => Ok(Sharding::Partial),
            _ => bail!("dims spec `{dims}`: at most one `(tp)` axis or one `partial(tp)`"),
        }
    }
}

/// Whether every shape has the rank of the first and agrees with it on every axis but `axis`.
pub fn same_off_axis(shapes: &[Vec<u64>], axis: usize) -> bool {
    let Some(first) = shapes.first() else {
        return true;
    };
    shapes.iter().all(|s| {
        s.len() == first.len()
            && s.iter()
                .zip(first)
                .enumerate()
                .all(|(i, (a, b))| i == axis || a == b)
    })
}

/// The whole tensor and its shape from rank-ordered parts of `shapes`.
pub fn unshard(
    sharding: &Sharding,
    parts: &[Vec<f32>],
    shapes: &[Vec<u64>],
) -> Result<(Vec<f32>, Vec<u64>)> {
    let Some(first) = shapes.first() else {
        bail!("no ranks to unshard");
    };
    for (r, (p, s)) in parts.iter().zip(shapes).enumerate() {
        if p.len() as u64 != s.iter().product::<u64>() {
            bail!("rank {r}: {} values for shape {s:?}", p.len());
        }
    }
    match sharding {
        Sharding::Replicated => Ok((parts[0].clone(), first.clone())),
        Sharding::Partial => {
            if shapes.iter().any(|s| s != first) {
                bail!("partial sums of different shapes: {shapes:?}");
            }
            let mut sum = vec![0f32; parts[0].len()];
            for p in parts {
                sum.iter_mut().zip(p).for_each(|(s, v)| *s += v);
            }
            Ok((sum, first.clone()))
        }
        Sharding::Split(axis) => {
            let axis = *axis;
            if axis >= first.len() {
                bail!("split axis {axis} past the shape {first:?}");
            }
            if !same_off_axis(shapes, axis) {
                bail!("parts differ off the split axis {axis}: {shapes:?}");
            }
            let outer: u64 = first[..axis].iter().product();
            let inner: u64 = first[axis + 1..].iter().product();
            let mut whole = Vec::with_capacity(parts.iter().map(Vec::len).sum());
            for o in 0..outer as usize {
                for (p, s) in parts.iter().zip(shapes) {
                    let block = (s[axis] * inner) as usize;
                    whole.extend_from_slice(&p[o * block..(o + 1) * block]);
                }
            }
            let mut shape = first.clone();
            shape[axis] = shapes.iter().map(|s| s[axis]).sum();
            Ok((whole, shape))
        }
    }
}

/// One rank's block of a stage split along `axis`: `start..start + len` of that axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub axis: usize,
    pub start: u64,
    pub len: u64,
}

impl Block {
    /// Rank `rank`'s block among parts of `shapes` (rank order) split by `sharding`; `None`
    /// where a part is no block of the whole (partial sums) or the shapes do not fit together.
    pub fn of_rank(sharding: &Sharding, shapes: &[Vec<u64>], rank: usize) -> Option<Block> {
        let mine = shapes.get(rank)?;
        match sharding {
            Sharding::Replicated => Some(Block {
                axis: 0,
                start: 0,
                len: *mine.first()?,
            }),
            Sharding::Split(axis) if same_off_axis(shapes, *axis) && *axis < mine.len() => {
                Some(Block {
                    axis: *axis,
                    start: shapes[..rank].iter().map(|s| s[*axis]).sum(),
                    len: mine[*axis],
                })
            }
            _ => None,
        }
    }

    /// The block's values out of `whole` of shape `shape`, with their shape; `None` where the
    /// block lies outside it.
    pub fn take(&self, whole: &[f32], shape: &[u64]) -> Option<(Vec<f32>, Vec<u64>)> {
        let along = *shape.get(self.axis)?;
        if self.start + self.len > along || whole.len() as u64 != shape.iter().product::<u64>() {
            return None;
        }
        let outer: u64 = shape[..self.axis].iter().product();
        let inner: u64 = shape[self.axis + 1..].iter().product();
        let mut out = Vec::with_capacity((outer * self.len * inner) as usize);
        for o in 0..outer {
            let at = ((o * along + self.start) * inner) as usize;
            out.extend_from_slice(&whole[at..at + (self.len * inner) as usize]);
        }
        let mut part = shape.to_vec();
        part[self.axis] = self.len;
        Some((out, part))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ranks_block_is_its_part_of_the_whole() {
        // Two tokens, heads split 1 + 1, head dim 2: the inverse of unshard.
        let parts = vec![vec![1., 2., 5., 6.], vec![3., 4., 7., 8.]];
        let shapes = vec![vec![2, 1, 2], vec![2, 1, 2]];
        let (whole, shape) = unshard(&Sharding::Split(1), &parts, &shapes).unwrap();
        for (rank, part) in parts.iter().enumerate() {
            let block = Block::of_rank(&Sharding::Split(1), &shapes, rank).unwrap();
            assert_eq!(
                block.take(&whole, &shape).unwrap(),
                (part.clone(), shapes[rank].clone())
            );
        }
        assert_eq!(Block::of_rank(&Sharding::Partial, &shapes, 0), None);
        let past = Block {
            axis: 1,
            start: 2,
            len: 1,
        };
        assert_eq!(past.take(&whole, &shape), None);
    }

    #[test]
    fn dims_specs_name_the_sharding() {
        assert_eq!(Sharding::of("t d").unwrap(), Sharding::Replicated);
        assert_eq!(Sharding::of("t h(tp) d").unwrap(), Sharding::Split(1));
        assert_eq!(Sharding::of("t v(tp)").unwrap(), Sharding::Split(1));
        assert_eq!(Sharding::of("t d partial(tp)").unwrap(), Sharding::Partial);
        assert!(Sharding::of("t h(tp) d(tp)").is_err());
    }

    #[test]
    fn heads_concatenate_per_token_and_partials_sum() {
        // Two tokens, heads split 1 + 1, head dim 2.
        let parts = vec![vec![1., 2., 5., 6.], vec![3., 4., 7., 8.]];
        let shapes = vec![vec![2, 1, 2], vec![2, 1, 2]];
        let (whole, shape) = unshard(&Sharding::Split(1), &parts, &shapes).unwrap();
        assert_eq!(shape, vec![2, 2, 2]);
        assert_eq!(whole, vec![1., 2., 3., 4., 5., 6., 7., 8.]);
        let (sum, _) = unshard(&Sharding::Partial, &parts, &shapes).unwrap();
        assert_eq!(sum, vec![4., 6., 12., 14.]);
    }
}
