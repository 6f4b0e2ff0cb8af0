//! Progress bars for long work: shown on a terminal, hidden under `--json` and when stderr is
//! not a terminal (CI, pipes), so machine-read output stays clean.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A progress bar over `len` items, hidden when `quiet` or when stderr is not a terminal.
pub fn progress(len: u64, quiet: bool, what: &str) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} {elapsed_precise}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}
