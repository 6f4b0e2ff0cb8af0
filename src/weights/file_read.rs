//! Positioned reads of weight bytes into memory that need not be initialized first.
//!
//! A weight's bytes are read into a fresh buffer of their size. Zero-filling that buffer first
//! (what `vec![0; n]` does) writes as many bytes as the read itself: in a profile of a MoE
//! layer at 8 tokens, where each routed expert's blocks are read once, the fill took 8% of the
//! samples. Here the kernel's read is the only writer.

use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;

use bytemuck::Pod;

/// `out.len()` bytes of `file` from offset `at` into `out`, every byte written on success.
pub fn read_exact_at(file: &File, mut at: u64, mut out: &mut [MaybeUninit<u8>]) -> io::Result<()> {
    while !out.is_empty() {
        let offset = libc::off_t::try_from(at)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "offset past off_t"))?;
        // SAFETY: `out` is valid for `out.len()` writes, and the kernel writes at most that many
        // bytes into it; what it wrote is counted before the slice moves on.
        let n =
            unsafe { libc::pread(file.as_raw_fd(), out.as_mut_ptr().cast(), out.len(), offset) };
        match n {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n if n < 0 => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => {
                out = &mut out[n as usize..];
                at += n as u64;
            }
        }
    }
    Ok(())
}

/// `n` values whose bytes `fill` writes into the room it is given.
///
/// # Safety
/// When `fill` returns `Ok`, it has written every byte of its room ([`read_exact_at`], and the
/// readers built on it, do, or fail).
pub unsafe fn filled_vec<T: Pod, E>(
    n: usize,
    fill: impl FnOnce(&mut [MaybeUninit<u8>]) -> Result<(), E>,
) -> Result<Vec<T>, E> {
    let mut v = Vec::<T>::with_capacity(n);
    let room = &mut v.spare_capacity_mut()[..n];
    let len = std::mem::size_of_val(room);
    // SAFETY: the first `n` values' room, as bytes: the same memory, byte-aligned.
    let bytes = unsafe { std::slice::from_raw_parts_mut(room.as_mut_ptr().cast(), len) };
    fill(bytes)?;
    // SAFETY: `fill` wrote every byte of the first `n` values (the caller's promise), and any
    // bytes are a valid `T` (`Pod`).
    unsafe { v.set_len(n) };
    Ok(v)
}

/// Initialized bytes seen as room to write.
///
/// # Safety
/// Only initialized bytes are written through the result (as the readers here write), so that
/// `bytes` stays initialized.
pub unsafe fn as_room(bytes: &mut [u8]) -> &mut [MaybeUninit<u8>] {
    // SAFETY: the same layout; the caller keeps the bytes initialized.
    unsafe { &mut *(bytes as *mut [u8] as *mut [MaybeUninit<u8>]) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reads_every_byte_from_the_offset() {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).unwrap();
        // SAFETY: read_exact_at writes every byte or fails.
        let got: Vec<u8> =
            unsafe { filled_vec(9_000, |room| read_exact_at(&f, 1_000, room)) }.unwrap();
        assert_eq!(got, data[1_000..]);
        // SAFETY: as above.
        let words: Vec<u32> = unsafe { filled_vec(4, |room| read_exact_at(&f, 0, room)) }.unwrap();
        assert_eq!(bytemuck::cast_slice::<u32, u8>(&words), &data[..16]);
    }

    #[test]
    fn a_read_past_the_end_is_an_error() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&[1, 2, 3]).unwrap();
        // SAFETY: read_exact_at writes every byte or fails.
        let got: io::Result<Vec<u8>> = unsafe { filled_vec(4, |room| read_exact_at(&f, 0, room)) };
        assert_eq!(got.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
    }
}
