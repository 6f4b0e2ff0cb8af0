//! Tensor parallelism on the CPU, as vLLM splits GLM-5 (see [`crate::shard::plan`]): a
//! ColumnParallel layer gives each rank a block of output rows, a RowParallel layer a block of
//! input columns whose partial products an all-reduce sums. Ranks run in parallel threads, each
//! on its own shard; collectives combine their results in rank order, so a TP run is
//! deterministic. A planted shard fault ([`Injection`]) changes which slice a rank gets.

use std::ops::Range;

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::backend::Backend;
use super::inject::Injection;
use super::lazy_weight::LazyWeight;
use super::mat::Mat;
use super::real::Real;
use crate::model::names::LayerWeight::{self, *};

/// A whole result and each rank's part of it.
pub type WithParts<E> = (Mat<E>, Vec<Mat<E>>);

/// The `[start, len)` of rank `rank`'s even share of `total`.
fn share(total: usize, rank: usize, tp: usize) -> Result<(usize, usize)> {
    if tp == 0 || total % tp != 0 {
        bail!("{total} does not split evenly over {tp} ranks");
    }
    Ok((rank * total / tp, total / tp))
}

/// Rank `rank`'s block of output rows of a `[out, in]` weight (ColumnParallel).
pub fn row_block(w: &Mat<f32>, rank: usize, tp: usize) -> Result<Mat<f32>> {
    let (start, len) = share(w.rows, rank, tp)?;
    Ok(Mat::new(
        len,
        w.cols,
        w.data[start * w.cols..(start + len) * w.cols].to_vec(),
    ))
}

/// Rank `rank`'s block of input columns of a `[out, in]` weight (RowParallel), or of an
/// activation's features.
pub fn column_block<E: Real>(m: &Mat<E>, rank: usize, tp: usize) -> Result<Mat<E>> {
    let (start, len) = share(m.cols, rank, tp)?;
    Ok(m.columns(start, len))
}

/// Whether vLLM splits `role` by output rows (ColumnParallel) rather than input columns.
pub fn is_column_parallel(role: LayerWeight) -> bool {
    matches!(
        role,
        QB | KvB | Gate | Up | SharedGate | SharedUp | ExpertsGate | ExpertsUp
    )
}

/// Which slice of a split weight each rank holds: the plan's, or a planted fault's.
#[derive(Clone, Copy, Debug)]
pub struct Sharder {
    pub tp: usize,
    /// Routed experts whole per rank (expert parallelism) rather than split.
    pub ep: bool,
    pub fault: Option<Injection>,
}

impl Sharder {
    /// The block of a `[rows, cols]` split weight `role` that rank `rank` holds, as row and
    /// column ranges: the plan's, or another rank's under a planted fault; `None` where the
    /// planted fault gives it no block of the matrix (the other axis's, reshaped).
    pub fn block(
        &self,
        role: LayerWeight,
        rank: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Option<(Range<usize>, Range<usize>)>> {
        let tp = self.tp;
        let from = match self.fault {
            Some(Injection::UnshardedColumn(f)) if f == role => 0,
            Some(Injection::RankOrder(f)) if f == role => tp - 1 - rank,
            Some(Injection::ShardAxis(f)) if f == role => return Ok(None),
            _ => rank,
        };
        Ok(Some(if is_column_parallel(role) {
            let (start, len) = share(rows, from, tp)?;
            (start..start + len, 0..cols)
        } else {
            let (start, len) = share(cols, from, tp)?;
            (0..rows, start..start + len)
        }))
    }

    /// Rank `rank`'s shard of the split weight `role` (`w` whole, `[out, in]`).
    pub fn shard(&self, w: &Mat<f32>, role: LayerWeight, rank: usize) -> Result<Mat<f32>> {
        if let Some((rows, cols)) = self.block(role, rank, w.rows, w.cols)? {
            let slab = &w.data[rows.start * w.cols..rows.end * w.cols];
            return Ok(Mat::new(rows.len(), w.cols, slab.to_vec()).columns(cols.start, cols.len()));
        }
        // A planted shard-axis fault: the other axis's block, viewed in the planned shape.
        let tp = self.tp;
        if is_column_parallel(role) {
            let other = column_block(w, rank, tp)?;
            Ok(Mat::new(w.rows / tp, w.cols, other.data))
        } else {
            let other = row_block(w, rank, tp)?;
            Ok(Mat::new(w.rows, w.cols / tp, other.data))
        }
    }
}

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
    Ok(Some(be.linear(x, &w.shard_held(&be, sharder, r)?)?))
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
        sum.data
            .iter()
            .zip(&whole.data)
            .for_each(|(a, b)| assert!((a - b).abs() < 1e-5));
        assert!(row_block(&w, 0, 3).is_err());
    }

    #[test]
    fn planted_faults_hand_out_other_slices() {
        let w = Mat::new(4, 2, (0..8).map(|v| v as f32).collect());
        let with = |fault| Sharder {
            tp: 2,
            ep: false,
            fault: Some(fault),
        };
        let unsharded = with(Injection::UnshardedColumn(KvB));
        assert_eq!(
            unsharded.shard(&w, KvB, 1).unwrap().data,
            vec![0., 1., 2., 3.]
        );
        assert_eq!(
            unsharded.shard(&w, QB, 1).unwrap().data,
            vec![4., 5., 6., 7.]
        );
        let reversed = with(Injection::RankOrder(KvB));
        assert_eq!(
            reversed.shard(&w, KvB, 0).unwrap().data,
            vec![4., 5., 6., 7.]
        );
        // Column 1 of every row, viewed as 2 rows of 2.
        let axis = with(Injection::ShardAxis(KvB)).shard(&w, KvB, 1).unwrap();
        assert_eq!(
            (axis.rows, axis.cols, axis.data),
            (2, 2, vec![1., 3., 5., 7.])
        );
    }
}
