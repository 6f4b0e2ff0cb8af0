//! A row-major matrix: activations, and weights as dequantized before a backend holds them.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use anyhow::{bail, Result};

use super::real::Real;

/// The values are shared, copied on write: a clone, or a stage handed to the trace writer for
/// its statistics, costs no copy until one side changes them.
#[derive(Clone, Debug, PartialEq)]
pub struct Mat<E = f32> {
    pub rows: usize,
    pub cols: usize,
    data: Arc<Vec<E>>,
    twin: Twin,
}

/// The same values held elsewhere by the backend that produced them (a GPU backend's output
/// buffer), so that the next op on that device takes them from there instead of uploading the
/// host's copy again. Only a backend's own type is stored, and only values equal to the host's;
/// any mutable access to the host's values drops it, so the two never disagree.
#[derive(Clone, Default)]
struct Twin(Option<Arc<dyn Any + Send + Sync>>);

impl fmt::Debug for Twin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "twin" } else { "-" })
    }
}

/// Twins hold the host's values, so they never make two matrices differ.
impl PartialEq for Twin {
    fn eq(&self, _: &Twin) -> bool {
        true
    }
}

impl<E: Real> Mat<E> {
    /// Panics when `data` does not hold `rows × cols` values: callers size both.
    pub fn new(rows: usize, cols: usize, data: Vec<E>) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix data does not match {rows}×{cols}"
        );
        Mat {
            rows,
            cols,
            data: Arc::new(data),
            twin: Twin::default(),
        }
    }

    /// The values, row-major.
    pub fn data(&self) -> &[E] {
        &self.data
    }

    /// The values to change in place, not in number (their twin, if any, dropped; copied first
    /// where they are shared).
    pub fn data_mut(&mut self) -> &mut [E] {
        self.twin = Twin::default();
        Arc::make_mut(&mut self.data).as_mut_slice()
    }

    /// The values, copied only where they are shared.
    pub fn into_data(self) -> Vec<E> {
        Arc::unwrap_or_clone(self.data)
    }

    /// The values, shared (for the trace writer).
    pub fn shared_data(&self) -> Arc<Vec<E>> {
        self.data.clone()
    }

    /// The matrix with `twin` beside its values: the backend's own copy of exactly these values.
    pub fn with_twin<T: Any + Send + Sync>(mut self, twin: T) -> Self {
        self.twin = Twin(Some(Arc::new(twin)));
        self
    }

    /// The twin beside the values, if one of type `T` is there.
    pub fn twin<T: Any>(&self) -> Option<&T> {
        self.twin.0.as_deref().and_then(|t| t.downcast_ref())
    }

    pub fn zeros(rows: usize, cols: usize) -> Self {
        Mat::new(rows, cols, vec![E::zero(); rows * cols])
    }

    /// A 2-D weight of row-major `shape`.
    pub fn from_shape(data: Vec<E>, shape: &[u64]) -> Result<Self> {
        match shape {
            [r, c] => Ok(Mat::new(*r as usize, *c as usize, data)),
            _ => bail!("shape {shape:?} is not a matrix"),
        }
    }

    pub fn row(&self, r: usize) -> &[E] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    pub fn row_mut(&mut self, r: usize) -> &mut [E] {
        let cols = self.cols;
        &mut self.data_mut()[r * cols..(r + 1) * cols]
    }

    /// Rows `rows` of the matrix, in that order.
    pub fn gather_rows(&self, rows: &[usize]) -> Mat<E> {
        let mut data = Vec::with_capacity(rows.len() * self.cols);
        for &r in rows {
            data.extend_from_slice(self.row(r));
        }
        Mat::new(rows.len(), self.cols, data)
    }

    /// Columns `start..start+len` of every row.
    pub fn columns(&self, start: usize, len: usize) -> Mat<E> {
        let data = (0..self.rows)
            .flat_map(|r| self.row(r)[start..start + len].iter().copied())
            .collect();
        Mat::new(self.rows, len, data)
    }

    /// Every value through `f`, e.g. into another number type.
    pub fn map<F: Real>(&self, f: impl Fn(E) -> F) -> Mat<F> {
        Mat::new(
            self.rows,
            self.cols,
            self.data.iter().map(|&v| f(v)).collect(),
        )
    }

    /// Element-wise sum.
    pub fn add(&self, other: &Mat<E>) -> Mat<E> {
        let data = self
            .data
            .iter()
            .zip(other.data.iter())
            .map(|(&a, &b)| a + b)
            .collect();
        Mat::new(self.rows, self.cols, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A twin lives only while the values it stands for do: a clone keeps it, every way to
    /// change the values drops it; values shared with another holder are copied before a change.
    #[test]
    fn a_change_drops_the_twin_and_leaves_shared_values_alone() {
        let m = Mat::new(2, 2, vec![1.0f32, 2.0, 3.0, 4.0]).with_twin(7u8);
        assert_eq!(m.twin::<u8>(), Some(&7));
        assert_eq!(m.twin::<u16>(), None, "another type is not the twin");
        let clone = m.clone();
        assert_eq!(clone.twin::<u8>(), Some(&7));

        let shared = m.shared_data();
        let mut changed = m.clone();
        changed.data_mut()[0] = 9.0;
        assert_eq!(changed.twin::<u8>(), None);
        assert_eq!(changed.data(), &[9.0, 2.0, 3.0, 4.0]);
        assert_eq!(shared.as_slice(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m.data(), &[1.0, 2.0, 3.0, 4.0]);

        let mut by_row = m.clone();
        by_row.row_mut(1)[1] = 0.5;
        assert_eq!(by_row.twin::<u8>(), None);
        assert_eq!(m.twin::<u8>(), Some(&7), "the original keeps its twin");

        assert_eq!(
            m.gather_rows(&[1, 0, 1]).data(),
            &[3.0, 4.0, 1.0, 2.0, 3.0, 4.0]
        );
        assert_eq!(
            m.gather_rows(&[1]).twin::<u8>(),
            None,
            "picked rows have no twin"
        );
    }
}
