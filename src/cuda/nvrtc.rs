//! CUDA C to CUBIN with NVRTC: CUBIN for the device's own architecture loads on any driver of
//! its generation, where the PTX of a newer NVRTC may not (CUDA 13.x NVRTC, driver 580).

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{bail, Result};
use cudarc::nvrtc::sys::{self, nvrtcProgram, nvrtcResult};

use super::KERNEL_HEADERS;

/// `strings` as NUL-terminated C strings.
fn c_strings<S: Into<Vec<u8>>>(strings: impl IntoIterator<Item = S>) -> Result<Vec<CString>> {
    Ok(strings
        .into_iter()
        .map(CString::new)
        .collect::<Result<_, _>>()?)
}

/// Pointers to `strings`, valid while they live.
fn pointers(strings: &[CString]) -> Vec<*const c_char> {
    strings.iter().map(|s| s.as_ptr()).collect()
}

fn check(what: &str, r: nvrtcResult) -> Result<()> {
    if r != nvrtcResult::NVRTC_SUCCESS {
        bail!("NVRTC {what}: {r:?}");
    }
    Ok(())
}

/// [`cubin`], compiled once per file and architecture in a process (every GPU of a TP run, every
/// run of a bisect, loads the same).
pub fn cubin_once(src: &str, name: &'static str, arch: &str) -> Result<Arc<Vec<u8>>> {
    /// CUBIN by kernel file and architecture.
    type Compiled = HashMap<(&'static str, String), Arc<Vec<u8>>>;
    static COMPILED: OnceLock<Mutex<Compiled>> = OnceLock::new();
    let mut compiled = COMPILED
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let key = (name, arch.to_string());
    if let Some(done) = compiled.get(&key) {
        return Ok(done.clone());
    }
    let done = Arc::new(cubin(src, name, arch)?);
    compiled.insert(key, done.clone());
    Ok(done)
}

/// `src` compiled for `arch` (`sm_90`), products and sums unfused (`--fmad=false`) so that
/// results round as the CPU's do. NVRTC reads no files: `#include "dtypes.cuh"` resolves to the
/// embedded [`KERNEL_HEADERS`], handed to it with the source.
pub fn cubin(src: &str, name: &str, arch: &str) -> Result<Vec<u8>> {
    let (src, name) = (CString::new(src)?, CString::new(name)?);
    let options = c_strings([format!("--gpu-architecture={arch}"), "--fmad=false".into()])?;
    let header_names = c_strings(KERNEL_HEADERS.map(|(file, _)| file))?;
    let header_srcs = c_strings(KERNEL_HEADERS.map(|(_, text)| text))?;
    let option_ptrs = pointers(&options);
    let (header_name_ptrs, header_src_ptrs) = (pointers(&header_names), pointers(&header_srcs));
    let mut prog: nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer is to a live NUL-terminated string; the program is destroyed below.
    unsafe {
        check(
            "create",
            sys::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                header_src_ptrs.len() as i32,
                header_src_ptrs.as_ptr(),
                header_name_ptrs.as_ptr(),
            ),
        )?;
        let compiled =
            sys::nvrtcCompileProgram(prog, option_ptrs.len() as i32, option_ptrs.as_ptr());
        let result = if compiled == nvrtcResult::NVRTC_SUCCESS {
            let mut size = 0usize;
            check("cubin size", sys::nvrtcGetCUBINSize(prog, &mut size)).and_then(|()| {
                let mut cubin = vec![0u8; size];
                check(
                    "cubin",
                    sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char),
                )?;
                Ok(cubin)
            })
        } else {
            let mut size = 0usize;
            sys::nvrtcGetProgramLogSize(prog, &mut size);
            let mut log = vec![0u8; size];
            sys::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char);
            let log = String::from_utf8_lossy(&log);
            // The compiler's log on one line, as every error of glmcheck is.
            let log: Vec<&str> = log
                .trim_end_matches('\0')
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            Err(anyhow::anyhow!(
                "NVRTC could not compile {}: {}",
                name.to_string_lossy(),
                log.join(" | ")
            ))
        };
        sys::nvrtcDestroyProgram(&mut prog);
        result
    }
}
