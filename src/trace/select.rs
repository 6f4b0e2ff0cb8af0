//! Which stages keep their full tensor (`--full GLOB`): the rest keep only their statistics, so
//! a 78-layer run stays small.
//!
//! Patterns are globs over stage names whose parts are the dot-separated words: `*` stays inside
//! one part and `**` spans any number, so the default `L*.out` takes the layer outputs `L3.out`
//! but not `L3.attn.out`.

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};

use super::error::{Result, TraceError};

/// The stages stored in full when nothing else is asked: the logits and the layer outputs.
pub const DEFAULT_FULL: [&str; 2] = ["logits", "L*.out"];

/// A set of `--full` patterns.
#[derive(Clone, Debug)]
pub struct FullSelector {
    set: GlobSet,
}

impl FullSelector {
    /// Compile `patterns`; an empty list selects nothing.
    pub fn new<S: AsRef<str>>(patterns: &[S]) -> Result<Self> {
        let mut set = GlobSetBuilder::new();
        for p in patterns {
            let p = p.as_ref();
            let bad = |e: globset::Error| TraceError::Pattern {
                pattern: p.to_string(),
                reason: e.kind().to_string(),
            };
            let glob = GlobBuilder::new(&as_path(p))
                .literal_separator(true)
                .build()
                .map_err(bad)?;
            set.add(glob);
        }
        let set = set.build().map_err(|e| TraceError::Pattern {
            pattern: patterns
                .iter()
                .map(AsRef::as_ref)
                .collect::<Vec<_>>()
                .join(" "),
            reason: e.kind().to_string(),
        })?;
        Ok(FullSelector { set })
    }

    /// Whether stage `name` keeps its full tensor.
    pub fn matches(&self, name: &str) -> bool {
        self.set.is_match(as_path(name))
    }
}

impl Default for FullSelector {
    fn default() -> Self {
        FullSelector::new(&DEFAULT_FULL).expect("the default patterns are valid globs")
    }
}

/// Dots become path separators so that globset's `*`/`**` rules apply to name parts.
fn as_path(name: &str) -> String {
    name.replace('.', "/")
}
