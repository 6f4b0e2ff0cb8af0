//! `glmcheck bisect`'s report: the diff of the candidate against the reference with what bisect
//! adds (the runs' setup, the weight check, the path behind an engine trace's divergence, the
//! hybrid runs and the replay), as JSON or terminal text ([`text`]); and the fault catalogue
//! (`--list-faults`, [`catalogue_text`]).

use std::fmt::Write;

use serde::Serialize;

use super::diff::text as diff_text;
use super::terminal::table;
use crate::compare::{DiffReport, Status};
use crate::diagnose::settings;
use crate::exec::faults::inject::CATALOGUE;
use crate::verify::Finding;

/// What bisect adds to a diff report.
#[derive(Serialize)]
pub struct BisectReport {
    #[serde(flatten)]
    pub diff: DiffReport,
    pub bisect: BisectInfo,
}

#[derive(Serialize)]
pub struct BisectInfo {
    pub model: String,
    pub prompt: Option<String>,
    pub candidate: String,
    /// Where the candidate ran: `cpu`, `cuda`, or the backend an engine trace names.
    pub backend: String,
    /// Where the reference and the envelope ran: `cpu` or `cuda`.
    pub reference_backend: &'static str,
    pub tp: u64,
    pub dtype: String,
    pub inject: Option<String>,
    pub envelope: Option<String>,
    /// Whether the envelope stores every weight as the candidate's files do (a conversion).
    pub conversion: bool,
    /// Top-k positions where the candidate took the reference's choice (near ties).
    pub ties_taken: usize,
    /// Top-k positions where an engine broke a near tie of the reference otherwise, and the
    /// reference and envelope were run again taking the engine's choice there.
    pub ties_followed: usize,
    /// Where the class came from: `drill-down` (weights, shards), `weights` (the conversion's
    /// weight check), `shard manifest`, `gguf metadata` or `engine config` (the settings an
    /// engine's trace says it ran with) or `traces`.
    pub classified_by: &'static str,
    /// A conversion's or an engine file's weight check (`--weights`): what was checked and
    /// found.
    pub weights: Option<WeightsInfo>,
    /// An engine trace's first divergence: the stages behind it the trace does not hold, and
    /// the weights and metadata keys checked for them.
    pub path: Option<PathInfo>,
    /// The forward's stages an engine trace does not hold, so never compared (its logits where
    /// SGLang's older dump hook wrote none), and what its reader noted about them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub not_recorded: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub candidate_notes: Vec<String>,
    /// `--mode logits`: the hybrid runs of the search, in the order they ran.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hybrids: Vec<HybridRun>,
    /// The first divergent stage re-run on the candidate from the reference's input to its
    /// block: made there (`fail`) or inherited (`pass`).
    pub replay: Option<Replay>,
    pub reference_text: Option<String>,
    pub candidate_text: Option<String>,
}

/// The way back from an engine trace's first divergence, in bisect's JSON.
#[derive(Clone, Debug, Serialize)]
pub struct PathInfo {
    /// The first divergent stage.
    pub divergent: String,
    /// The stages behind it that the trace does not hold, in the forward's order.
    pub hidden: Vec<String>,
    /// The stages behind it that the trace keeps as statistics only, whose agreement proves
    /// little (a permutation or a sign keeps every moment): the path goes on through them.
    pub statistics_only: Vec<String>,
    /// The engine's weight file (the GGUF or checkpoint its trace names), where at hand.
    pub file: Option<String>,
    /// That file's tensors which the path's stages read.
    pub tensors: Vec<String>,
    /// The GGUF metadata keys or engine config fields whose stages lie on the path (all
    /// compared with the reference).
    pub keys: Vec<String>,
}

/// What the weight check did, in bisect's JSON.
#[derive(Clone, Debug, Serialize)]
pub struct WeightsInfo {
    /// `all` or `divergent`.
    pub checked: &'static str,
    pub tensors: usize,
    pub exact: usize,
    pub within_noise: usize,
    pub failed: usize,
    /// The candidate's stored bytes the check read (the reference's of the same tensors are
    /// read beside them), and its wall time: what the check of a large file costs.
    pub bytes_read: u64,
    pub seconds: f64,
    pub findings: Vec<Finding>,
}

/// One hybrid run: up to which block the candidate computed, and how its logits compared.
#[derive(Clone, Debug, Serialize)]
pub struct HybridRun {
    /// The first block on the reference: 0 the embedding, `l + 1` layer `l`, `L + 1` the head.
    pub switch: usize,
    /// The last block on the candidate, by its output stage (`none` at switch 0).
    pub candidate_through: String,
    pub status: Status,
    pub rel_diff: f64,
}

/// The divergent stage re-run on the candidate from the reference's input to its block.
#[derive(Clone, Debug, Serialize)]
pub struct Replay {
    /// The stage the replay starts at (the block's input is the reference's).
    pub from: String,
    pub stage: String,
    pub status: Status,
    pub rel_diff: f64,
}

impl Replay {
    /// One line of evidence.
    pub fn evidence(&self) -> String {
        match self.status {
            Status::Fail => format!(
                "replayed from the reference's input to {}: {} still diverges (rel_diff {:.3e}): \
                 the fault is made there, not inherited",
                self.from, self.stage, self.rel_diff
            ),
            Status::Pass => format!(
                "replayed from the reference's input to {}: {} agrees (rel_diff {:.3e}): the \
                 divergence is inherited from smaller errors before it",
                self.from, self.stage, self.rel_diff
            ),
        }
    }
}

/// The fault catalogue, and the settings named from an engine trace's metadata.
pub fn catalogue_text() -> String {
    let mut out = String::new();
    let mut t = table(&["fault", "ARG", "class", "first divergence", "needs", "what"]);
    for e in CATALOGUE {
        let needs = match (e.needs_tp, e.dtype) {
            (true, _) => "--tp ≥ 2".to_string(),
            (false, Some(d)) => format!("--dtype {d}"),
            (false, None) => "-".into(),
        };
        t.add_row(vec![
            e.name.to_string(),
            e.arg.to_string(),
            e.class.name().to_string(),
            e.stage.to_string(),
            needs,
            e.what.to_string(),
        ]);
    }
    let _ = writeln!(out, "{t}");
    let _ = writeln!(
        out,
        "\nnamed from the settings an engine trace records (the GGUF metadata llama.cpp read, \
         the config.json vLLM or transformers took), not planted:"
    );
    let mut t = table(&[
        "GGUF key",
        "config field",
        "class",
        "first divergence",
        "what",
    ]);
    for k in &settings::KEYS {
        t.add_row(vec![
            k.key.map_or("-".to_string(), |k| format!("<arch>.{k}")),
            k.fields
                .iter()
                .map(|f| settings::config_name(f))
                .collect::<Vec<_>>()
                .join(" / "),
            k.class.name().to_string(),
            k.stages.join(" or "),
            k.does.to_string(),
        ]);
    }
    let _ = writeln!(out, "{t}");
    out
}

/// The diff's text, then the runs' setup, the weight check, the path behind an engine trace's
/// divergence, the near ties, the diagnosis and what each side generated.
pub fn text(report: &BisectReport) -> String {
    let mut out = String::new();
    let b = &report.bisect;
    out.push_str(&diff_text(&report.diff));
    let _ = writeln!(out);
    let on = match b.backend.as_str() {
        "cpu" => "on the CPU".to_string(),
        "cuda" => "on CUDA GPUs".to_string(),
        other => format!("from {other}"),
    };
    let setup = format!(
        "candidate: {} {on} at TP {}, {}{}",
        b.candidate,
        b.tp,
        b.dtype,
        b.inject
            .as_ref()
            .map(|f| format!(", --inject {f}"))
            .unwrap_or_default()
    );
    let _ = writeln!(out, "{setup}");
    if !b.not_recorded.is_empty() {
        const SHOWN: usize = 8;
        let more = b.not_recorded.len().saturating_sub(SHOWN);
        let _ = writeln!(
            out,
            "not in the candidate's trace, never compared: {}{}",
            b.not_recorded[..b.not_recorded.len().min(SHOWN)].join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
    for note in &b.candidate_notes {
        let _ = writeln!(out, "  · {note}");
    }
    if let Some(e) = &b.envelope {
        let stored = if b.conversion {
            format!(", every weight stored as {} stores it", b.candidate)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "noise envelope: the reference re-run at {}{stored} ({e})",
            b.dtype
        );
    }
    if let Some(w) = &b.weights {
        let which = if w.checked == "all" {
            "every tensor"
        } else {
            "the tensors behind the divergent stage"
        };
        let _ = writeln!(
            out,
            "weight check ({which}): {} tensors, {} exact (ggml's bytes), {} within their type's \
             noise, {} failed; {:.1} MiB of the file read in {:.1} s",
            w.tensors,
            w.exact,
            w.within_noise,
            w.failed,
            w.bytes_read as f64 / (1u64 << 20) as f64,
            w.seconds
        );
    }
    let behind = |p: &&PathInfo| !p.hidden.is_empty() || !p.statistics_only.is_empty();
    if let Some(p) = b.path.as_ref().filter(behind) {
        if !p.hidden.is_empty() {
            let _ = writeln!(
                out,
                "behind {}: the engine's trace holds no {}",
                p.divergent,
                p.hidden.join(", ")
            );
        }
        if !p.statistics_only.is_empty() {
            let _ = writeln!(
                out,
                "behind {}: kept as statistics only, which a permutation or a sign leaves as \
                 they were: {}",
                p.divergent,
                p.statistics_only.join(", ")
            );
        }
        if !p.tensors.is_empty() || !p.keys.is_empty() {
            let checked: Vec<&str> = p
                .tensors
                .iter()
                .chain(&p.keys)
                .map(String::as_str)
                .collect();
            let _ = writeln!(out, "  checked for them: {}", checked.join(", "));
        }
    }
    if b.ties_taken > 0 {
        let _ = writeln!(
            out,
            "{} top-k positions were near ties in the reference; the candidate took the \
             reference's choice there",
            b.ties_taken
        );
    }
    if b.ties_followed > 0 {
        let _ = writeln!(
            out,
            "{} top-k positions were near ties in the reference that the engine broke otherwise; \
             the reference and the envelope took the engine's choice there",
            b.ties_followed
        );
    }
    match (&report.diff.first_divergence, &report.diff.fault) {
        (Some(d), Some(f)) => {
            let rank = d.rank.map(|r| format!(" rank {r}")).unwrap_or_default();
            let source = match b.classified_by {
                "drill-down" => "from the weights and shards behind that stage",
                "weights" => "from the check of the candidate's weights against the reference",
                "shard manifest" => "from the engine's shard manifest",
                "gguf metadata" => "from the GGUF metadata the engine read",
                "engine config" => "from the config.json the engine took",
                _ => "from the traces",
            };
            let _ = writeln!(
                out,
                "\ndiagnosis: {} at {}{rank} ({source})",
                f.class.name(),
                d.stage
            );
            let _ = writeln!(out, "  {}", f.summary);
            for e in &f.evidence {
                let _ = writeln!(out, "  · {e}");
            }
        }
        _ => {
            let _ = writeln!(
                out,
                "\ndiagnosis: no fault — the candidate agrees with the reference"
            );
        }
    }
    if let (Some(p), Some(r)) = (&b.prompt, &b.reference_text) {
        let _ = writeln!(out, "\nreference: {p}{r}");
        if let Some(c) = &b.candidate_text {
            let _ = writeln!(out, "candidate: {p}{c}");
        }
    }
    out
}
