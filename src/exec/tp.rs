//! Tensor parallelism on the CPU, as vLLM splits GLM-5 (see [`crate::shard::plan`]): a
//! ColumnParallel layer gives each rank a block of output rows, a RowParallel layer a block of
//! input columns whose partial products an all-reduce sums. Ranks run one after another in
//! rank order, so a TP run is deterministic; its parts are recorded per rank.

use anyhow::{bail, Result};

use super::backend::Backend;
use super::mat::Mat;
use super::real::Real;

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

/// A ColumnParallel layer: each rank's `x · W_rᵀ`, in rank order.
pub fn column_parallel<B: Backend>(
    be: &B,
    x: &Mat<B::E>,
    w: &Mat<f32>,
    tp: usize,
) -> Result<Vec<Mat<B::E>>> {
    (0..tp)
        .map(|r| be.linear(x, &be.hold(row_block(w, r, tp)?)?))
        .collect()
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

/// The sum of the ranks' partial results in rank order, held in the dtype (an all-reduce).
pub fn all_reduce<B: Backend>(be: &B, parts: &[Mat<B::E>]) -> Mat<B::E> {
    let mut sum = parts[0].clone();
    for p in &parts[1..] {
        sum = be.add(&sum, p);
    }
    sum
}

/// A RowParallel layer: the all-reduced sum of the ranks' partial `x_r · W_rᵀ` over their
/// input columns, and the partials.
pub fn row_parallel<B: Backend>(
    be: &B,
    x_parts: &[Mat<B::E>],
    w: &Mat<f32>,
) -> Result<WithParts<B::E>> {
    let tp = x_parts.len();
    let partials = x_parts
        .iter()
        .enumerate()
        .map(|(r, x)| be.linear(x, &be.hold(column_block(w, r, tp)?)?))
        .collect::<Result<Vec<_>>>()?;
    let sum = all_reduce(be, &partials);
    Ok((sum, partials))
}

/// An MLP (`down(silu(gate·x) ⊙ up·x)`) with gate/up ColumnParallel and down RowParallel: the
/// all-reduced output and the ranks' partial outputs.
pub fn mlp<B: Backend>(
    be: &B,
    x: &Mat<B::E>,
    [gate, up, down]: [&Mat<f32>; 3],
    tp: usize,
) -> Result<WithParts<B::E>> {
    let g = column_parallel(be, x, gate, tp)?;
    let u = column_parallel(be, x, up, tp)?;
    let h: Vec<Mat<B::E>> = g.iter().zip(&u).map(|(g, u)| be.silu_mul(g, u)).collect();
    row_parallel(be, &h, down)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::backend::{Cpu, Precision};

    #[test]
    fn column_then_row_parallel_equals_the_whole_product() {
        let be = Cpu::new(Precision::F32);
        let x = Mat::new(2, 4, vec![1., 2., 3., 4., -1., 0.5, 2., -3.]);
        let w = Mat::new(4, 4, (0..16).map(|v| v as f32 * 0.25 - 1.0).collect());
        let whole = be.linear(&x, &be.hold(w.clone()).unwrap()).unwrap();
        let parts = column_parallel(&be, &x, &w, 2).unwrap();
        assert_eq!(concat_columns(&parts), whole);
        let x_parts = [
            column_block(&x, 0, 2).unwrap(),
            column_block(&x, 1, 2).unwrap(),
        ];
        let (sum, _) = row_parallel(&be, &x_parts, &w).unwrap();
        sum.data
            .iter()
            .zip(&whole.data)
            .for_each(|(a, b)| assert!((a - b).abs() < 1e-5));
        assert!(row_block(&w, 0, 3).is_err());
    }
}
