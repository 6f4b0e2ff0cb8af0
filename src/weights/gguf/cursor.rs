//! A bounds-checked little-endian reader over a byte slice that names what it was reading when the
//! bytes ran out, so a truncated or hostile file ends in one precise error line.

use std::path::Path;

use crate::weights::{Result, WeightError};

pub struct Cursor<'a> {
    file: &'a Path,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    pub fn new(file: &'a Path, buf: &'a [u8]) -> Self {
        Cursor { file, buf, pos: 0 }
    }

    pub fn pos(&self) -> u64 {
        self.pos as u64
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub fn file(&self) -> &'a Path {
        self.file
    }

    /// An error about `field` at the current position.
    pub fn error(&self, field: &str, reason: impl Into<String>) -> WeightError {
        WeightError::malformed(self.file, field, self.pos as u64, reason)
    }

    pub fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.error(
                field,
                format!(
                    "needs {n} bytes, file has {} left (truncated?)",
                    self.remaining()
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N]> {
        let s = self.take(N, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    pub fn u8(&mut self, field: &str) -> Result<u8> {
        Ok(self.array::<1>(field)?[0])
    }
    pub fn i8(&mut self, field: &str) -> Result<i8> {
        Ok(i8::from_le_bytes(self.array(field)?))
    }
    pub fn u16(&mut self, field: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }
    pub fn i16(&mut self, field: &str) -> Result<i16> {
        Ok(i16::from_le_bytes(self.array(field)?))
    }
    pub fn u32(&mut self, field: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }
    pub fn i32(&mut self, field: &str) -> Result<i32> {
        Ok(i32::from_le_bytes(self.array(field)?))
    }
    pub fn u64(&mut self, field: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }
    pub fn i64(&mut self, field: &str) -> Result<i64> {
        Ok(i64::from_le_bytes(self.array(field)?))
    }
    pub fn f32(&mut self, field: &str) -> Result<f32> {
        Ok(f32::from_le_bytes(self.array(field)?))
    }
    pub fn f64(&mut self, field: &str) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array(field)?))
    }

    /// A count that must fit in the bytes left, given each item takes at least `min_item` bytes:
    /// this is what keeps a hostile count from driving a huge allocation or a long loop.
    pub fn count(&mut self, field: &str, min_item: usize) -> Result<usize> {
        let at = self.pos as u64;
        let n = self.u64(field)?;
        let fits = usize::try_from(n)
            .ok()
            .filter(|&n| n.saturating_mul(min_item.max(1)) <= self.remaining());
        fits.ok_or_else(|| {
            WeightError::malformed(
                self.file,
                field,
                at,
                format!(
                    "{n} items cannot fit in the {} bytes left",
                    self.remaining()
                ),
            )
        })
    }

    /// A GGUF string: u64 length, then UTF-8 bytes.
    pub fn string(&mut self, field: &str) -> Result<String> {
        let len = self.count(field, 1)?;
        let at = self.pos as u64;
        let bytes = self.take(len, field)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            WeightError::malformed(self.file, field, at, format!("invalid UTF-8 ({e})"))
        })
    }
}
