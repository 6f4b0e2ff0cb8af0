use std::process::ExitCode;

use clap::Parser;
use glmcheck::cli::{self, Cli};

fn main() -> ExitCode {
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
