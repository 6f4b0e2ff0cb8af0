//! A row-major f32 matrix, the activation and weight type of the CPU reference; products go
//! through candle's CPU GEMM, everything else is plain loops that read like the model's math.

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

#[derive(Clone, Debug, PartialEq)]
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Mat {
    /// Panics when `data` does not hold `rows × cols` values: callers size both.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix data does not match {rows}×{cols}"
        );
        Mat { rows, cols, data }
    }

    /// A 2-D weight of row-major `shape`.
    pub fn from_shape(data: Vec<f32>, shape: &[u64]) -> Result<Self> {
        match shape {
            [r, c] => Ok(Mat::new(*r as usize, *c as usize, data)),
            _ => bail!("shape {shape:?} is not a matrix"),
        }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        &mut self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Columns `start..start+len` of every row.
    pub fn columns(&self, start: usize, len: usize) -> Mat {
        let data = (0..self.rows)
            .flat_map(|r| self.row(r)[start..start + len].iter().copied())
            .collect();
        Mat::new(self.rows, len, data)
    }

    /// `self · wᵀ` for a weight `w` of `[out, in]` (PyTorch's `F.linear`).
    pub fn linear(&self, w: &Mat) -> Result<Mat> {
        if self.cols != w.cols {
            bail!(
                "linear: input has {} features, weight expects {}",
                self.cols,
                w.cols
            );
        }
        let x = Tensor::from_slice(&self.data, (self.rows, self.cols), &Device::Cpu)?;
        let wt = Tensor::from_slice(&w.data, (w.rows, w.cols), &Device::Cpu)?.t()?;
        let y = x.matmul(&wt)?;
        Ok(Mat::new(self.rows, w.rows, y.flatten_all()?.to_vec1()?))
    }

    /// Element-wise sum.
    pub fn add(&self, other: &Mat) -> Mat {
        let data = self
            .data
            .iter()
            .zip(&other.data)
            .map(|(a, b)| a + b)
            .collect();
        Mat::new(self.rows, self.cols, data)
    }
}
