//! Which slice of a split weight each tensor-parallel rank holds: vLLM's plan
//! ([`crate::shard::plan`], the one source of the split rules), or the slice a planted shard
//! fault hands out instead.

use std::ops::Range;

use anyhow::{bail, Result};

use crate::exec::faults::hooks::Hooks;
use crate::exec::faults::inject::Injection;
use crate::exec::mat::Mat;
use crate::exec::real::Real;
use crate::model::names::LayerWeight;
use crate::shard::plan::splits_rows;

/// The `[start, len)` of rank `rank`'s even share of `total`.
fn share(total: usize, rank: usize, tp: usize) -> Result<(usize, usize)> {
    if tp == 0 || !total.is_multiple_of(tp) {
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
        w.data()[start * w.cols..(start + len) * w.cols].to_vec(),
    ))
}

/// Rank `rank`'s block of input columns of a `[out, in]` weight (RowParallel), or of an
/// activation's features.
pub fn column_block<E: Real>(m: &Mat<E>, rank: usize, tp: usize) -> Result<Mat<E>> {
    let (start, len) = share(m.cols, rank, tp)?;
    Ok(m.columns(start, len))
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
        let Some(from) = Hooks::new(self.fault).slice_of(role, rank, tp) else {
            return Ok(None);
        };
        Ok(Some(if splits_rows(role) {
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
            let slab = &w.data()[rows.start * w.cols..rows.end * w.cols];
            return Ok(Mat::new(rows.len(), w.cols, slab.to_vec()).columns(cols.start, cols.len()));
        }
        // A planted shard-axis fault: the other axis's block, viewed in the planned shape.
        let tp = self.tp;
        if splits_rows(role) {
            let other = column_block(w, rank, tp)?;
            Ok(Mat::new(w.rows / tp, w.cols, other.into_data()))
        } else {
            let other = row_block(w, rank, tp)?;
            Ok(Mat::new(w.rows, w.cols / tp, other.into_data()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::names::LayerWeight::{KvB, QB};

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
            unsharded.shard(&w, KvB, 1).unwrap().into_data(),
            vec![0., 1., 2., 3.]
        );
        assert_eq!(
            unsharded.shard(&w, QB, 1).unwrap().into_data(),
            vec![4., 5., 6., 7.]
        );
        let reversed = with(Injection::RankOrder(KvB));
        assert_eq!(
            reversed.shard(&w, KvB, 0).unwrap().into_data(),
            vec![4., 5., 6., 7.]
        );
        // Column 1 of every row, viewed as 2 rows of 2.
        let axis = with(Injection::ShardAxis(KvB)).shard(&w, KvB, 1).unwrap();
        assert_eq!(
            (axis.rows, axis.cols, axis.into_data()),
            (2, 2, vec![1., 3., 5., 7.])
        );
    }
}
