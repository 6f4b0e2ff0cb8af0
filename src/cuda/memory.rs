//! What glmcheck holds on each GPU: a meter of the bytes held now and at most, the device
//! buffers that count themselves on it while they live, a rank's use of its GPU in a run, and
//! the page-locked host buffer its copies go through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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

    /// Bytes it holds now.
    fn capacity(&self) -> usize {
        self.0.as_ref().map_or(0, |s| s.len())
    }

    /// The first `bytes` bytes as a copy into the buffer left them (the copy waited for).
    pub(super) fn landed(&self, bytes: usize) -> Result<&[u8]> {
        let all = self
            .0
            .as_ref()
            .context("no page-locked buffer to read")?
            .as_slice()?;
        all.get(..bytes).context("page-locked buffer too short")
    }
}

/// Page-locked buffers for copies made outside a device's lock, on any thread (fetches of an
/// op's output left on the GPU, a stage's statistics on their way back): each user takes one (or
/// a new one) and gives it back, so users at once never wait for each other.
#[derive(Default)]
pub(super) struct Staging(Mutex<Vec<Pinned>>);

impl Staging {
    /// A buffer for `bytes`: the smallest one that holds them, else the largest one (grown by
    /// its user), else a new one. Page-locking memory takes milliseconds for tens of MB: a
    /// large fetch must not get the small buffer of a stage's statistics.
    pub(super) fn take(&self, bytes: usize) -> Pinned {
        let mut buffers = self.buffers();
        let fits = buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= bytes)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        let pick = fits.or_else(|| (0..buffers.len()).max_by_key(|&i| buffers[i].capacity()));
        pick.map(|i| buffers.swap_remove(i)).unwrap_or_default()
    }

    pub(super) fn give(&self, pinned: Pinned) {
        self.buffers().push(pinned);
    }

    fn buffers(&self) -> std::sync::MutexGuard<'_, Vec<Pinned>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
