//! Giving mapped weight pages back to the kernel once they are decoded, so that reading a 402 GB
//! model leaves resident memory at one chunk, not at the bytes read so far.

use std::ops::Range;

use memmap2::{Mmap, UncheckedAdvice};

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
