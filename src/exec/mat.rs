//! A row-major matrix: activations, and weights as dequantized before a backend holds them.

use anyhow::{bail, Result};

use super::real::Real;

#[derive(Clone, Debug, PartialEq)]
pub struct Mat<E = f32> {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<E>,
}

impl<E: Real> Mat<E> {
    /// Panics when `data` does not hold `rows × cols` values: callers size both.
    pub fn new(rows: usize, cols: usize, data: Vec<E>) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix data does not match {rows}×{cols}"
        );
        Mat { rows, cols, data }
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
        &mut self.data[r * self.cols..(r + 1) * self.cols]
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
            .zip(&other.data)
            .map(|(&a, &b)| a + b)
            .collect();
        Mat::new(self.rows, self.cols, data)
    }
}
