//! vLLM's fp16 residual guard, as the forward holds the stream under it.

use std::borrow::Cow;

use anyhow::Result;

use crate::dtype::Precision;
use crate::exec::backend::Backend;
use crate::exec::mat::Mat;
use crate::exec::real::Real;
use crate::exec::source::WeightSource;

/// vLLM's fp16 guard against overflow: the residual stream held divided by
/// `routed_scaling_factor` (each layer's attention and FFN outputs scaled down before they are
/// added; RMSNorm does not see the scale). Stages are recorded in the reference's units. Only
/// in f16, and not under `--inject fp16-overflow`.
#[derive(Clone, Copy)]
pub(super) struct ResidualScale<E>(Option<E>);

impl<E: Real> ResidualScale<E> {
    pub(super) fn of<B: Backend<E = E>>(src: &WeightSource, be: &B) -> Self {
        let guarded = be.precision() == Precision::F16 && src.hooks().fp16_residual_rescale();
        ResidualScale(guarded.then(|| E::lit(src.cfg.routed_scaling_factor)))
    }

    /// `m` in the stream's units, held in the dtype.
    pub(super) fn down<B: Backend<E = E>>(&self, be: &B, mut m: Mat<E>) -> Result<Mat<E>> {
        if let Some(c) = self.0 {
            m.data_mut().iter_mut().for_each(|v| *v /= c);
            be.round(m.data_mut())?;
        }
        Ok(m)
    }

    /// The stream `x`, held by this scale, as `next` holds it (a hybrid run changing sides).
    pub(super) fn convert<B: Backend<E = E>>(
        &self,
        be: &B,
        next: Self,
        x: Mat<E>,
    ) -> Result<Mat<E>> {
        if self.0 == next.0 {
            return Ok(x);
        }
        next.down(be, self.up(&x).into_owned())
    }

    /// The stream `m` in the reference's units.
    pub(super) fn up<'m>(&self, m: &'m Mat<E>) -> Cow<'m, Mat<E>> {
        match self.0 {
            None => Cow::Borrowed(m),
            Some(c) => Cow::Owned(Mat::new(
                m.rows,
                m.cols,
                m.data().iter().map(|&v| v * c).collect(),
            )),
        }
    }
}
