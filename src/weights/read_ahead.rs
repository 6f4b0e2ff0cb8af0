//! Asking the kernel to read the file ranges a run needs next, so that the disk works while the
//! cores compute. A MoE layer reads its chosen experts one group at a time when it multiplies by
//! them; without a hint each group's read waited on the disk with the cores idle, and the cores
//! then computed with the disk idle. A cold run of the full model reads 402 GB, minutes of disk
//! at any speed, so the two should overlap.
//!
//! The hints go to a thread of its own, in the order given (the order the layer reads them),
//! which passes each to the kernel (`posix_fadvise(WILLNEED)`: read into the page cache without
//! waiting); the kernel may block that thread while its queue is full, never the forward. A
//! hint is only a hint: a failed one changes nothing but the time the later read takes.

use std::fs::File;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::mpsc::{channel, Sender};
use std::sync::OnceLock;

/// A range of bytes of a file.
pub type FileRange = (PathBuf, Range<u64>);

/// Ranges to be read soon, in the order they will be read.
pub fn ask(ranges: Vec<FileRange>) {
    if ranges.is_empty() {
        return;
    }
    static WORKER: OnceLock<Option<Sender<Vec<FileRange>>>> = OnceLock::new();
    let worker = WORKER.get_or_init(|| {
        let (tx, rx) = channel::<Vec<FileRange>>();
        let started = std::thread::Builder::new()
            .name("glmcheck-read-ahead".into())
            .spawn(move || {
                let mut open: Option<(PathBuf, File)> = None;
                for ranges in rx {
                    for (path, range) in ranges {
                        hint(&mut open, &path, range);
                    }
                }
            });
        started.ok().map(|_| tx)
    });
    if let Some(tx) = worker {
        // The thread lives as long as the process; a send cannot fail while it does.
        let _ = tx.send(ranges);
    }
}

/// One range passed to the kernel, the file kept open for the next range of the same file.
fn hint(open: &mut Option<(PathBuf, File)>, path: &PathBuf, range: Range<u64>) {
    if open.as_ref().is_none_or(|(p, _)| p != path) {
        *open = File::open(path).ok().map(|f| (path.clone(), f));
    }
    let Some((_, file)) = open else {
        return;
    };
    let (Ok(start), Ok(len)) = (
        libc::off_t::try_from(range.start),
        libc::off_t::try_from(range.end.saturating_sub(range.start)),
    ) else {
        return;
    };
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; the advice reads nothing into this process's memory.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), start, len, libc::POSIX_FADV_WILLNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, start, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hints for ranges of a real file, one past its end and one of a missing file are taken
    /// without an error or a panic, and the file reads the same afterwards.
    #[test]
    fn hints_change_nothing_but_timing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bytes");
        let bytes: Vec<u8> = (0..1u32 << 16).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        ask(vec![
            (path.clone(), 0..4096),
            (path.clone(), 60_000..1 << 20),
            (dir.path().join("missing"), 0..10),
            (path.clone(), u64::MAX - 1..u64::MAX),
        ]);
        ask(Vec::new());
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }
}
