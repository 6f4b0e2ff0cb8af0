//! What glmcheck holds on each GPU: a meter of the bytes held now and at most, the device
//! buffers that count themselves on it while they live, a rank's use of its GPU in a run, and
//! the page-locked host buffer its copies go through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use cudarc::driver::{CudaSlice, DeviceRepr, PinnedHostSlice};

use super::Gpu;

/// Bytes glmcheck holds on one GPU now and at most so far.
#[derive(Default)]
pub(super) struct Meter {
    now: AtomicU64,
    pub(super) peak: AtomicU64,
}

impl Meter {
    pub(super) fn take(&self, bytes: u64) {
        let now = self.now.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    pub(super) fn give(&self, bytes: u64) {
        self.now.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// One rank's use of its GPU in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankMemory {
    /// The most bytes glmcheck held on the GPU at once.
    pub peak_bytes: u64,
    /// Bytes of stored weight blocks kept on the GPU.
    pub resident_bytes: u64,
    /// Bytes of dequantized weights kept on the GPU for a run's later passes, at the end.
    pub kept_weight_bytes: u64,
    /// Bytes of stored blocks read from the model files and uploaded, and the seconds taken.
    pub loaded_bytes: u64,
    pub load_seconds: f64,
}

/// A device buffer counted on its GPU's meter while it lives.
pub(super) struct Buffer<D: DeviceRepr> {
    pub(super) slice: CudaSlice<D>,
    pub(super) meter: Arc<Meter>,
}

impl<D: DeviceRepr> Drop for Buffer<D> {
    fn drop(&mut self) {
        self.meter
            .give((self.slice.len() * std::mem::size_of::<D>()) as u64);
    }
}

/// Page-locked host memory that copies to and from a GPU pass through: the DMA engine copies it
/// at the link's speed, where pageable memory goes through the driver's own staging, a few GB/s.
/// Every user waits for its copy before it returns, so one buffer serves them all in turn.
#[derive(Default)]
pub(super) struct Pinned(Option<PinnedHostSlice<u8>>);

impl Pinned {
    /// The buffer's first `bytes` bytes, grown to the next power of two at least that large (so
    /// that a run allocates it a few times at most).
    pub(super) fn bytes(&mut self, gpu: &Gpu, bytes: usize) -> Result<&mut [u8]> {
        if self.0.as_ref().is_none_or(|s| s.len() < bytes) {
            self.0 = None;
            let ctx = gpu.stream.context();
            // SAFETY: callers write every byte they read (a file's blocks, converted values, a
            // copy from the GPU).
            let pinned = unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes.next_power_of_two(), 0) }
                .with_context(|| format!("{bytes} bytes of page-locked memory"))?;
            self.0 = Some(pinned);
        }
        let all = self.0.as_mut().expect("allocated above").as_mut_slice()?;
        Ok(&mut all[..bytes])
    }
}
