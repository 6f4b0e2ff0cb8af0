use std::process::ExitCode;

use clap::Parser;
use glmcheck::cli::{self, Cli};

/// Layers dequantize gigabytes into fresh buffers and drop them: the system allocator hands each
/// back to the kernel and faults the next one in 4 KiB at a time (most of a GLM-5-width run's
/// time); mimalloc reuses them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its place in `mi_option_t`).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed memory stays with the process for reuse, never given back to the kernel: by default
/// mimalloc gives back what lay unused for a second, and a run's next pass or layer faulted it
/// in again, zeroed, 2 MiB at a time (8% of a 512-token GPU forward on an H200's host). The
/// process's peak is unchanged.
const NEVER: std::os::raw::c_long = -1;

fn main() -> ExitCode {
    // `glmcheck diff A B | head` ends quietly, as Unix tools do, instead of failing to print.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // SAFETY: sets one of mimalloc's options, which it reads when it next purges.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, NEVER) };
    let cli = Cli::parse();
    match run_on_the_pool(cli) {
        Ok(outcome) => ExitCode::from(outcome as u8),
        Err(e) => {
            // One line, the whole cause chain: "file: field at byte N: reason".
            eprintln!("glmcheck: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// A main thread's usual stack on Linux, for the pool thread that runs the command.
const COMMAND_STACK_BYTES: usize = 8 << 20;

/// The command on one of the thread pool's threads rather than beside them, where the pool has
/// two or more. A forward alternates serial steps with parallel ones (every linear): from outside
/// the pool, each parallel step woke the pool and put the calling thread to sleep until it was
/// done, and the pool's idle threads spun beside each serial step. On 2 cores that was 8% of a
/// warm `small` forward, most of it showing as time in `record`. A pool of one thread stays free:
/// the trace writer's statistics run there while the command may be waiting for the writer.
fn run_on_the_pool(cli: Cli) -> anyhow::Result<cli::Outcome> {
    // The pool's threads get the stack a main thread has (theirs is 2 MiB by default). Building
    // the pool fails only where it exists already, which it does not before the command starts.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(COMMAND_STACK_BYTES)
        .build_global();
    if rayon::current_num_threads() < 2 {
        return cli::run(cli);
    }
    rayon::scope(|_| cli::run(cli))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_purge_delay_option_is_mimallocs() {
        // Its default, 1000 ms, which no other option of mimalloc's has.
        // SAFETY: reads an option.
        assert_eq!(unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) }, 1000);
    }
}
