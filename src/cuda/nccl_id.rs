//! The NCCL unique id that one process per rank share through a file: rank 0 makes it and writes
//! it (atomically, by rename), the other ranks wait for the file and read it.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::nccl::Id;

/// The bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

/// Rank 0: a fresh id, written to `file`. Other ranks: the id rank 0 wrote there, waiting for it
/// at most `wait`.
pub fn exchange(file: &Path, rank: usize, wait: Duration) -> Result<Id> {
    if rank == 0 {
        let id = Id::new().map_err(|e| anyhow!("NCCL unique id: {e:?}"))?;
        let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
        let tmp = file.with_extension("partial");
        std::fs::write(&tmp, &bytes).with_context(|| format!("{}", tmp.display()))?;
        std::fs::rename(&tmp, file).with_context(|| format!("{}", file.display()))?;
        return Ok(id);
    }
    let start = Instant::now();
    let bytes = loop {
        match std::fs::read(file) {
            Ok(b) => break b,
            Err(_) if start.elapsed() < wait => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => bail!(
                "{}: no NCCL id from rank 0 after {} s: {e}",
                file.display(),
                wait.as_secs_f64()
            ),
        }
    };
    if bytes.len() != ID_BYTES {
        bail!(
            "{}: an NCCL id is {ID_BYTES} bytes, the file holds {}",
            file.display(),
            bytes.len()
        );
    }
    let mut internal = [0 as std::ffi::c_char; ID_BYTES];
    internal
        .iter_mut()
        .zip(&bytes)
        .for_each(|(c, &b)| *c = b as std::ffi::c_char);
    Ok(Id::uninit(internal))
}
