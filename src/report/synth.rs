//! `glmcheck synth`'s report: what was written, how fast, and the model's config; as JSON or one
//! line of terminal text.

use std::fmt::Write;
use std::path::PathBuf;

use serde::Serialize;

use super::sorted_keys;
use super::terminal::bytes;
use crate::model::config::Glm5Config;
use crate::synth::Written;

/// One synthetic model written.
#[derive(Clone, Debug, Serialize)]
pub struct SynthReport {
    #[serde(serialize_with = "sorted_keys")]
    pub config: Glm5Config,
    pub seconds: f64,
    #[serde(serialize_with = "sorted_keys")]
    pub written: Written,
    /// The `.gguf` file or Hugging Face folder.
    #[serde(skip)]
    pub out: PathBuf,
}

/// What was written, its size and speed, and the tensors that hold random blocks.
pub fn text(r: &SynthReport) -> String {
    let mut out = String::new();
    let w = &r.written;
    let _ = writeln!(
        out,
        "wrote {} ({} tensors, {}) in {:.2} s, {:.0} MB/s; types {:?}",
        r.out.display(),
        w.tensors,
        bytes(w.bytes),
        r.seconds,
        w.bytes as f64 / r.seconds / 1e6,
        w.types
    );
    if !w.random_blocks.is_empty() {
        let _ = writeln!(
            out,
            "{} tensors hold random valid blocks, not the model's weights (no quantizer for their type, or --fast)",
            w.random_blocks.len()
        );
    }
    out
}
