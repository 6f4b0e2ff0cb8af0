//! Weight bytes read in place in a file's map, and their pages given back to the kernel once
//! used, so that reading a 402 GB model leaves resident memory at what is in use, not at the
//! bytes read so far.

use std::ops::{Deref, Range};
use std::sync::Arc;

use memmap2::{Advice, Mmap, UncheckedAdvice};

/// Drop `range` of a read-only file map from this process's resident set. The pages stay in the
/// page cache; touching them again faults them back in with the same bytes.
pub fn release(map: &Mmap, range: Range<usize>) {
    if range.is_empty() || range.end > map.len() {
        return;
    }
    // SAFETY: the map is read-only and file-backed, so MADV_DONTNEED cannot discard data: any
    // later access re-reads the unchanged file. It is only a hint; failure changes nothing.
    let _ =
        unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, range.start, range.len()) };
}

/// Bytes of a shared file map, read in place: a weight's GGML blocks without a copy out of the
/// page cache. Their pages leave this process's resident set when the bytes are dropped.
pub struct MappedBytes {
    map: Arc<Mmap>,
    range: Range<usize>,
}

impl MappedBytes {
    /// `range` of `map`, every page of it mapped now, as a positioned read would have read it:
    /// the kernel is asked for the whole range at once (on a cold file, one deep queue of reads
    /// instead of a fault's read-ahead window at a time), then maps every page in one call,
    /// not a fault per few pages on whichever thread decodes them.
    ///
    /// # Panics
    /// If `range` is not within `map`.
    pub fn new(map: Arc<Mmap>, range: Range<usize>) -> MappedBytes {
        assert!(range.start <= range.end && range.end <= map.len());
        if !range.is_empty() {
            // Hints only (kernels before 5.14 refuse the second): what they skip, faults do.
            let _ = map.advise_range(Advice::WillNeed, range.start, range.len());
            let _ = map.advise_range(Advice::PopulateRead, range.start, range.len());
        }
        MappedBytes { map, range }
    }
}

impl Deref for MappedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map[self.range.clone()]
    }
}

impl Drop for MappedBytes {
    fn drop(&mut self) {
        release(&self.map, self.range.clone());
    }
}
