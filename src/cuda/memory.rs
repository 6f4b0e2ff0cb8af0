//! What glmcheck holds on each GPU: a meter of the bytes held now and at most, the device
//! buffers that count themselves on it while they live and leave their memory for the next
//! buffer of their size, a rank's use of its GPU in a run, and the page-locked host buffer its
//! copies go through.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError, PinnedHostSlice};

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
    /// The most bytes glmcheck held on the GPU at once in live buffers (not the freed memory its
    /// `FreeList` keeps for reuse, 2 GiB at most).
    pub peak_bytes: u64,
    /// Bytes of stored weight blocks kept on the GPU.
    pub resident_bytes: u64,
    /// Bytes of dequantized weights kept on the GPU for a run's later passes, at the end.
    pub kept_weight_bytes: u64,
    /// Bytes of stored blocks read from the model files and uploaded, and the seconds taken.
    pub loaded_bytes: u64,
    pub load_seconds: f64,
}

/// A device buffer counted on its GPU's meter while it lives, its memory left to the GPU's
/// [`FreeList`] when it goes.
pub(super) struct Buffer<D: DeviceRepr> {
    pub(super) slice: ManuallyDrop<CudaSlice<D>>,
    pub(super) meter: Arc<Meter>,
    pub(super) free: Arc<FreeList>,
}

impl<D: DeviceRepr> Drop for Buffer<D> {
    fn drop(&mut self) {
        self.meter
            .give((self.slice.len() * std::mem::size_of::<D>()) as u64);
        // SAFETY: the slice is taken once, here, and the field is not used after.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        self.free.keep(slice);
    }
}

/// Bytes of freed device memory a GPU's [`FreeList`] keeps at most; past them a buffer's memory
/// goes back to the driver.
const FREE_LIST_BYTES: usize = 2 << 30;

/// Device memory a GPU's buffers freed, kept by size for the next buffer of that size: a
/// forward allocates and frees about a thousand buffers a pass, each a driver call of
/// microseconds on the host's critical path. Reuse is ordered by the stream: every buffer lives
/// on its GPU's one stream (where cudarc tracks events, giving a slice up waits for its uses).
pub(super) struct FreeList {
    stream: Arc<CudaStream>,
    held: Mutex<FreeMemory>,
}

#[derive(Default)]
struct FreeMemory {
    by_bytes: HashMap<usize, Vec<CUdeviceptr>>,
    bytes: usize,
}

impl FreeList {
    pub(super) fn new(stream: Arc<CudaStream>) -> FreeList {
        FreeList {
            stream,
            held: Mutex::default(),
        }
    }

    /// A buffer of `len` values on this list's stream, counted on `meter`: memory freed
    /// earlier of its size where the list kept some, else the driver's; where the driver has
    /// none left, what the list kept is given back and the allocation tried again. Not zeroed:
    /// the caller writes every value before any is read.
    pub(super) fn buffer<D: DeviceRepr>(
        self: &Arc<Self>,
        meter: &Arc<Meter>,
        len: usize,
    ) -> Result<Buffer<D>, DriverError> {
        let slice = match self.take::<D>(len) {
            Some(slice) => slice,
            // SAFETY: the caller writes every value before any is read.
            None => match unsafe { self.stream.alloc::<D>(len) } {
                Ok(slice) => slice,
                Err(_) => {
                    self.release();
                    // SAFETY: as above.
                    unsafe { self.stream.alloc::<D>(len) }?
                }
            },
        };
        meter.take((len * std::mem::size_of::<D>()) as u64);
        Ok(Buffer {
            slice: ManuallyDrop::new(slice),
            meter: meter.clone(),
            free: self.clone(),
        })
    }

    /// A slice of `len` values of memory freed earlier, of exactly its bytes, if any.
    fn take<D: DeviceRepr>(&self, len: usize) -> Option<CudaSlice<D>> {
        let bytes = len * std::mem::size_of::<D>();
        let ptr = {
            let mut held = self.lock();
            let ptr = held.by_bytes.get_mut(&bytes)?.pop()?;
            held.bytes -= bytes;
            ptr
        };
        // SAFETY: `ptr` holds `bytes` bytes of this stream's device, freed by its last owner
        // (whose work on it the stream orders before any new use); the caller writes it or
        // zeroes it before it is read.
        Some(unsafe { self.stream.upgrade_device_ptr(ptr, len) })
    }

    /// `slice`'s memory kept for the next buffer of its size, or freed where the list is full.
    fn keep<D: DeviceRepr>(&self, slice: CudaSlice<D>) {
        let bytes = slice.len() * std::mem::size_of::<D>();
        let mut held = self.lock();
        if bytes == 0 || held.bytes + bytes > FREE_LIST_BYTES {
            drop(held);
            drop(slice);
            return;
        }
        held.bytes += bytes;
        held.by_bytes.entry(bytes).or_default().push(slice.leak());
    }

    /// Every kept buffer freed: the driver's memory back for an allocation that failed, or
    /// for good.
    pub(super) fn release(&self) {
        let by_bytes = std::mem::take(&mut *self.lock()).by_bytes;
        for (bytes, ptrs) in by_bytes {
            for ptr in ptrs {
                // SAFETY: as in `take`; the slice frees it on the stream when dropped here.
                drop(unsafe { self.stream.upgrade_device_ptr::<u8>(ptr, bytes) });
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, FreeMemory> {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for FreeList {
    fn drop(&mut self) {
        if self.stream.context().bind_to_thread().is_ok() {
            self.release();
        }
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

/// Requests up to this many bytes may take any buffer up to four times as large.
const SMALL_PINNED: usize = 64 << 10;

/// Page-locked buffers for copies made outside a device's lock, on any thread (fetches of an
/// op's output left on the GPU, a stage's statistics on their way back): each user takes one (or
/// a new one) and gives it back, so users at once never wait for each other.
#[derive(Default)]
pub(super) struct Staging(Mutex<Vec<Pinned>>);

impl Staging {
    /// A buffer for `bytes`: the smallest one that holds them unless it is many times larger,
    /// else the largest smaller one (grown by its user), else a new one. Page-locking memory
    /// takes milliseconds for tens of MB: a large fetch must not find its buffer held by a
    /// stage's statistics and page-lock another.
    pub(super) fn take(&self, bytes: usize) -> Pinned {
        let mut buffers = self.buffers();
        let fits = buffers
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= bytes)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, b)| (i, b.capacity()));
        let pick = match fits {
            Some((i, capacity)) if capacity <= bytes.max(SMALL_PINNED).saturating_mul(4) => Some(i),
            Some(_) => None,
            None => (0..buffers.len()).max_by_key(|&i| buffers[i].capacity()),
        };
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
