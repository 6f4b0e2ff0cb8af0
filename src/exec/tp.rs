//! Tensor parallelism on the CPU, as vLLM splits GLM-5 (see [`crate::shard::plan`]): a
//! ColumnParallel layer gives each rank a block of output rows, a RowParallel layer a block of
//! input columns whose partial products an all-reduce sums. Ranks run in parallel threads, each
//! on its own shard; collectives combine their results in rank order, so a TP run is
//! deterministic. Which slice a rank gets is the [`Sharder`]'s.

use anyhow::Result;
use rayon::prelude::*;

use crate::exec::backend::Backend;
use crate::exec::mat::Mat;
use crate::exec::real::Real;
use crate::exec::source::lazy_weight::LazyWeight;
use crate::exec::source::sharder::Sharder;

/// A whole result and each rank's part of it.
pub type WithParts<E> = (Mat<E>, Vec<Mat<E>>);

/// A ColumnParallel layer: each rank's `x · W_rᵀ`, the ranks in parallel.
pub fn column_parallel<B: Backend>(
    be: &B,
    x: &Mat<B::E>,
    w: &LazyWeight<'_>,
    sharder: Sharder,
) -> Result<Vec<Mat<B::E>>> {
    let parts = (0..sharder.tp)
        .into_par_iter()
        .map(|r| rank_linear(be, x, w, sharder, r))
        .collect::<Result<Vec<_>>>()?;
    be.gather(parts)
}

/// Rank `r`'s `x · W_rᵀ` on its device, if this process computes that rank.
fn rank_linear<B: Backend>(
    be: &B,
    x: &Mat<B::E>,
    w: &LazyWeight<'_>,
    sharder: Sharder,
    r: usize,
) -> Result<Option<Mat<B::E>>> {
    if !be.computes(r) {
        return Ok(None);
    }
    let be = be.on_rank(r);
    Ok(Some(be.linear(x, &*w.shard_held(&be, sharder, r)?)?))
}

/// The ranks' column blocks side by side (the all-gather of a ColumnParallel output).
pub fn concat_columns<E: Real>(parts: &[Mat<E>]) -> Mat<E> {
    let rows = parts.first().map_or(0, |p| p.rows);
    let cols = parts.iter().map(|p| p.cols).sum();
    let mut data = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for p in parts {
            data.extend_from_slice(p.row(r));
        }
    }
    Mat::new(rows, cols, data)
}

/// A RowParallel layer: the all-reduced sum of the ranks' partial `x_r · W_rᵀ` over their
/// input columns, and the partials.
pub fn row_parallel<B: Backend>(
    be: &B,
    x_parts: &[Mat<B::E>],
    w: &LazyWeight<'_>,
    sharder: Sharder,
) -> Result<WithParts<B::E>> {
    let partials = row_partials(be, x_parts, w, sharder)?;
    let sum = be.all_reduce(&partials)?;
    Ok((sum, partials))
}

/// The ranks' partial `x_r · W_rᵀ` of a RowParallel layer, before their all-reduce.
fn row_partials<B: Backend>(
    be: &B,
    x_parts: &[Mat<B::E>],
    w: &LazyWeight<'_>,
    sharder: Sharder,
) -> Result<Vec<Mat<B::E>>> {
    let partials = x_parts
        .par_iter()
        .enumerate()
        .map(|(r, x)| rank_linear(be, x, w, sharder, r))
        .collect::<Result<Vec<_>>>()?;
    be.gather(partials)
}

/// An MLP (`down(silu(gate·x) ⊙ up·x)`) with gate/up ColumnParallel and down RowParallel: the
/// ranks' partial outputs, before their all-reduce (routed experts add theirs up first).
pub fn mlp_partials<B: Backend>(
    be: &B,
    x: &Mat<B::E>,
    [gate, up, down]: [&LazyWeight<'_>; 3],
    sharder: Sharder,
) -> Result<Vec<Mat<B::E>>> {
    let g = column_parallel(be, x, gate, sharder)?;
    let u = column_parallel(be, x, up, sharder)?;
    let h = g
        .iter()
        .zip(&u)
        .enumerate()
        .map(|(r, (g, u))| be.on_rank(r).silu_mul(g, u))
        .collect::<Result<Vec<_>>>()?;
    row_partials(be, &h, down, sharder)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Precision;
    use crate::exec::backend::Cpu;
    use crate::exec::source::sharder::{column_block, row_block};
    use crate::model::names::LayerWeight::{AttnOut, QB};

    #[test]
    fn column_then_row_parallel_equals_the_whole_product() {
        let be = Cpu::new(Precision::F32);
        let x = Mat::new(2, 4, vec![1., 2., 3., 4., -1., 0.5, 2., -3.]);
        let w = Mat::new(4, 4, (0..16).map(|v| v as f32 * 0.25 - 1.0).collect());
        let whole = be.linear(&x, &be.hold(w.clone()).unwrap()).unwrap();
        let plan = Sharder {
            tp: 2,
            ep: false,
            fault: None,
        };
        let parts = column_parallel(&be, &x, &LazyWeight::given(QB, w.clone()), plan).unwrap();
        assert_eq!(concat_columns(&parts), whole);
        let x_parts = [
            column_block(&x, 0, 2).unwrap(),
            column_block(&x, 1, 2).unwrap(),
        ];
        let o_proj = LazyWeight::given(AttnOut, w.clone());
        let (sum, _) = row_parallel(&be, &x_parts, &o_proj, plan).unwrap();
        sum.into_data()
            .iter()
            .zip(&whole.into_data())
            .for_each(|(a, b)| assert!((a - b).abs() < 1e-5));
        assert!(row_block(&w, 0, 3).is_err());
    }
}
