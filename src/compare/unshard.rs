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

#[cfg(test)]
mod tests {
    use super::*;

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
