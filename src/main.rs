use std::process::ExitCode;

use clap::Parser;
use glmcheck::cli::{self, Cli};

/// Layers dequantize gigabytes into fresh buffers and drop them: the system allocator hands each
/// back to the kernel and faults the next one in 4 KiB at a time (most of a GLM-5-width run's
/// time); mimalloc reuses them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // `glmcheck diff A B | head` ends quietly, as Unix tools do, instead of failing to print.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    match cli::run(cli) {
        Ok(outcome) => ExitCode::from(outcome as u8),
        Err(e) => {
            // One line, the whole cause chain: "file: field at byte N: reason".
            eprintln!("glmcheck: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
