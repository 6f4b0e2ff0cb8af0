//! The dtypes the GPUs hold activations and weights in (f32, bf16, f16): their cuBLAS (and
//! NCCL) type, the rounding from f32, and a weight's buffer in whichever of them the run uses.

use cudarc::cublas::sys::cudaDataType;
use cudarc::nccl::NcclType;
use half::{bf16, f16};

use super::memory::Buffer;
use super::DequantOutput;

/// A dtype the GPU holds activations and weights in (its kernels' suffix and widening come
/// from [`DequantOutput`]).
pub(super) trait Dtype:
    DequantOutput + NcclType + bytemuck::Pod + Unpin + Send + Sync + 'static
{
    const CUDA: cudaDataType;
    /// `v` rounded to nearest even (exact for values the dtype holds).
    fn from_f32(v: f32) -> Self;
    /// A weight buffer of this dtype.
    fn held(buf: Buffer<Self>) -> Held;
    /// A held weight's buffer, if it is of this dtype.
    fn of(held: &Held) -> Option<&Buffer<Self>>;
}

impl Dtype for f32 {
    const CUDA: cudaDataType = cudaDataType::CUDA_R_32F;
    fn from_f32(v: f32) -> Self {
        v
    }
    fn held(buf: Buffer<Self>) -> Held {
        Held::F32(buf)
    }
    fn of(held: &Held) -> Option<&Buffer<Self>> {
        match held {
            Held::F32(buf) => Some(buf),
            _ => None,
        }
    }
}

impl Dtype for bf16 {
    const CUDA: cudaDataType = cudaDataType::CUDA_R_16BF;
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn held(buf: Buffer<Self>) -> Held {
        Held::Bf16(buf)
    }
    fn of(held: &Held) -> Option<&Buffer<Self>> {
        match held {
            Held::Bf16(buf) => Some(buf),
            _ => None,
        }
    }
}

impl Dtype for f16 {
    const CUDA: cudaDataType = cudaDataType::CUDA_R_16F;
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn held(buf: Buffer<Self>) -> Held {
        Held::F16(buf)
    }
    fn of(held: &Held) -> Option<&Buffer<Self>> {
        match held {
            Held::F16(buf) => Some(buf),
            _ => None,
        }
    }
}

/// A weight's buffer on its GPU, in the run's dtype.
pub(super) enum Held {
    F32(Buffer<f32>),
    Bf16(Buffer<bf16>),
    F16(Buffer<f16>),
}

impl Held {
    /// Bytes of the buffer on the GPU.
    pub(super) fn bytes(&self) -> u64 {
        let (n, size) = match self {
            Held::F32(b) => (b.slice.len(), 4),
            Held::Bf16(b) => (b.slice.len(), 2),
            Held::F16(b) => (b.slice.len(), 2),
        };
        (n * size) as u64
    }
}
