//! What glmcheck holds on each GPU: a meter of the bytes held now and at most, the device
//! buffers that count themselves on it while they live, and a rank's use of its GPU in a run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr};

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
