//! A cache tensor as the passes of a run added it: one matrix a pass, each pass's rows the
//! positions it processed. The cache keeps each pass's output as the op left it (shared, not
//! copied), so a backend that still holds a prompt's rows on its device reads them there.

use crate::exec::mat::Mat;
use crate::exec::real::Real;

/// The passes' matrices, in order; together `[positions, cols]`.
#[derive(Clone, Copy)]
pub struct Passes<'a, E>(pub &'a [Mat<E>]);

impl<'a, E: Real> Passes<'a, E> {
    /// Every position's row, in order (the host's values, fetched where they were left
    /// elsewhere).
    pub fn rows(&self) -> Vec<&'a [E]> {
        self.0
            .iter()
            .flat_map(|m| m.data().chunks_exact(m.cols.max(1)).take(m.rows))
            .collect()
    }

    /// The positions the passes hold.
    pub fn positions(&self) -> usize {
        self.0.iter().map(|m| m.rows).sum()
    }

    /// Whether every pass has rows of `cols` values.
    pub fn have_cols(&self, cols: usize) -> bool {
        self.0.iter().all(|m| m.cols == cols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_run_through_the_passes_in_order() {
        let prompt = Mat::new(3, 2, vec![0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let generated = Mat::new(1, 2, vec![6.0f32, 7.0]);
        let cache = [prompt, generated];
        let passes = Passes(&cache);
        assert_eq!(passes.positions(), 4);
        assert!(passes.have_cols(2) && !passes.have_cols(3));
        let rows = passes.rows();
        assert_eq!(
            rows,
            vec![&[0.0, 1.0][..], &[2.0, 3.0], &[4.0, 5.0], &[6.0, 7.0]]
        );
        assert_eq!(Passes::<f32>(&[]).positions(), 0);
    }
}
