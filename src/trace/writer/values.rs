//! A stage's values as the forward hands them to the writer: borrowed, owned and shared, or
//! still on their way from a GPU.

use std::borrow::Cow;
use std::sync::Arc;

use rayon::prelude::*;
use safetensors::Dtype;

use crate::trace::manifest::ElemType;
use crate::trace::stats::TensorStats;

/// The values of one stage as the caller holds them.
#[derive(Clone, Copy, Debug)]
pub enum Stage<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    I32(&'a [i32]),
}

impl Stage<'_> {
    pub(super) fn len(self) -> usize {
        match self {
            Stage::F32(v) => v.len(),
            Stage::F64(v) => v.len(),
            Stage::I32(v) => v.len(),
        }
    }

    pub(super) fn elem_type(self) -> ElemType {
        match self {
            Stage::F32(_) => ElemType::F32,
            Stage::F64(_) => ElemType::F64,
            Stage::I32(_) => ElemType::I32,
        }
    }

    pub(super) fn to_owned(self) -> OwnedStage {
        match self {
            Stage::F32(v) => OwnedStage::F32(Arc::new(copied(v))),
            Stage::F64(v) => OwnedStage::F64(Arc::new(copied(v))),
            Stage::I32(v) => OwnedStage::I32(copied(v)),
        }
    }
}

/// Values per parallel task of a stage's copy.
const COPY_CHUNK: usize = 1 << 15;

/// `v` copied on the thread pool's cores: a stage at GLM-5's widths and 512 tokens is tens of
/// MB, and one core's copy of it held up the forward. A stage of one task's size is copied
/// here, without handing the forward's thread to the pool and back.
pub(super) fn copied<T: Copy + Send + Sync>(v: &[T]) -> Vec<T> {
    if v.len() <= COPY_CHUNK {
        return v.to_vec();
    }
    v.par_iter().with_min_len(COPY_CHUNK).copied().collect()
}

/// `v` as little-endian bytes: its own bytes, not copied, on a little-endian host.
pub(super) fn le_bytes<T: bytemuck::Pod, const N: usize>(
    v: &[T],
    to_le: fn(T) -> [u8; N],
) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(v.iter().flat_map(|&x| to_le(x)).collect())
    }
}

/// A stage's values owned by the writer, for statistics computed beside the forward: copied
/// out of it, handed over where the forward is done with them, or shared with the forward's
/// matrix (which copies them before it changes them).
pub enum OwnedStage {
    F32(Arc<Vec<f32>>),
    F64(Arc<Vec<f64>>),
    I32(Vec<i32>),
}

impl OwnedStage {
    pub fn view(&self) -> Stage<'_> {
        match self {
            OwnedStage::F32(v) => Stage::F32(v),
            OwnedStage::F64(v) => Stage::F64(v),
            OwnedStage::I32(v) => Stage::I32(v),
        }
    }

    pub(super) fn stats(&self) -> TensorStats {
        match self {
            OwnedStage::F32(v) => TensorStats::of(v),
            OwnedStage::F64(v) => TensorStats::of(v),
            OwnedStage::I32(v) => TensorStats::of(v),
        }
    }

    /// The values as safetensors stores them: little-endian bytes.
    pub(super) fn le_bytes(&self) -> Cow<'_, [u8]> {
        match self {
            OwnedStage::F32(v) => le_bytes(v, f32::to_le_bytes),
            OwnedStage::F64(v) => le_bytes(v, f64::to_le_bytes),
            OwnedStage::I32(v) => le_bytes(v, i32::to_le_bytes),
        }
    }

    pub(super) fn dtype(&self) -> Dtype {
        match self {
            OwnedStage::F32(_) => Dtype::F32,
            OwnedStage::F64(_) => Dtype::F64,
            OwnedStage::I32(_) => Dtype::I32,
        }
    }
}

/// A stage's values still on their way (a copy from a GPU queued beside the forward): waited
/// for when called, by the writing thread.
pub type StageLater = Box<dyn FnOnce() -> anyhow::Result<OwnedStage> + Send>;
