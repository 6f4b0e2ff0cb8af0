//! Reports for people and for machines: every command's report is typed here and rendered here,
//! so that the command line only parses, calls and prints. A comparison renders as terminal
//! text ([`diff`]), GitHub-flavoured Markdown for CI job summaries ([`markdown()`]) and one
//! self-contained HTML file with inline SVG plots ([`html()`]), all from a [`DiffReport`]; the
//! logits of both traces, when they hold them, add the logits' health and, in HTML, their
//! histogram. [`bisect`] adds the runs' setup and the diagnosis to it; [`gate`] renders the
//! gate's verdict as text, JUnit and Markdown; [`verify`] a checkpoint's check as text and
//! Markdown. The other commands' reports ([`run`], [`logits`], [`synth`], [`shards`],
//! [`inspect`], [`dequant`], [`selftest`]) print as JSON or as terminal tables ([`terminal`]).
//! Their fields are declared in the order their JSON has always printed them, alphabetical;
//! library types nested in them keep that order through [`sorted_keys`].
//!
//! Every string taken from a trace (stage names, paths, fault text) is escaped for the format
//! it lands in: a trace is input, not markup.

pub mod bisect;
pub mod dequant;
pub mod diff;
pub mod endpoint;
pub mod escape;
pub mod gate;
pub mod html;
pub mod inspect;
pub mod logits;
pub mod markdown;
pub mod run;
pub mod selftest;
pub mod shards;
pub mod synth;
pub mod terminal;
pub mod verify;

use anyhow::{Context, Result};
use serde::{Serialize, Serializer};

use crate::compare::logits::{LogitsComparison, LogitsHealth};
use crate::compare::stage_diff::{whole_values, Basis};
use crate::compare::{DiffReport, StageDiff, Status};
use crate::trace::Trace;

pub use html::html;
pub use markdown::markdown;

/// One trace's `logits` stage: `[positions, vocab]` row-major, with its health.
#[derive(Clone, Debug)]
pub struct LogitsSide {
    pub values: Vec<f32>,
    pub positions: usize,
    pub vocab: usize,
    pub health: LogitsHealth,
}

impl LogitsSide {
    /// `values` of `shape` (the last dimension is the vocabulary).
    pub fn new(values: Vec<f32>, shape: &[u64]) -> Option<LogitsSide> {
        let vocab = shape.last().copied().unwrap_or(0) as usize;
        if vocab == 0 || values.is_empty() || !values.len().is_multiple_of(vocab) {
            return None;
        }
        let health = LogitsHealth::of(&values, vocab);
        Some(LogitsSide {
            positions: values.len() / vocab,
            vocab,
            health,
            values,
        })
    }

    /// The logits of one position.
    pub fn row(&self, position: usize) -> &[f32] {
        &self.values[position * self.vocab..(position + 1) * self.vocab]
    }
}

/// The logits of the two traces compared, as far as they hold them (values, not statistics).
#[derive(Clone, Debug)]
pub struct LogitsView {
    pub reference: Option<LogitsSide>,
    pub candidate: Option<LogitsSide>,
    /// When both sides hold logits of one shape.
    pub comparison: Option<LogitsComparison>,
}

impl LogitsView {
    /// The `logits` stage of both traces (rank parts unsharded); `None` when neither holds its
    /// values.
    pub fn read(reference: &Trace, candidate: &Trace) -> Result<Option<LogitsView>> {
        let side = |t: &Trace| -> Result<Option<LogitsSide>> {
            Ok(whole_values(t, "logits")
                .with_context(|| format!("{}: logits", t.dir().display()))?
                .and_then(|(v, shape)| LogitsSide::new(v, &shape)))
        };
        Ok(LogitsView::new(side(reference)?, side(candidate)?))
    }

    /// The view of two sides; `None` when both are missing.
    pub fn new(reference: Option<LogitsSide>, candidate: Option<LogitsSide>) -> Option<Self> {
        if reference.is_none() && candidate.is_none() {
            return None;
        }
        let comparison = match (&reference, &candidate) {
            (Some(r), Some(c)) if r.vocab == c.vocab && r.positions == c.positions => {
                Some(LogitsComparison::of(&r.values, &c.values, r.vocab))
            }
            _ => None,
        };
        Some(LogitsView {
            reference,
            candidate,
            comparison,
        })
    }
}

/// Serializes `value` with every object's keys in alphabetical order: the order the commands'
/// JSON has always given the library types nested in it, whatever their declaration order.
pub fn sorted_keys<T: Serialize, S: Serializer>(
    value: &T,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    serde_json::to_value(value)
        .map_err(serde::ser::Error::custom)?
        .serialize(s)
}

/// `PASS` / `FAIL`.
pub(crate) fn verdict_word(s: Status) -> &'static str {
    match s {
        Status::Pass => "PASS",
        Status::Fail => "FAIL",
    }
}

/// The report's verdict in one word: `PARTIAL` where a trace is partial and its stages show no
/// divergence (never a pass), else the verdict's.
pub(crate) fn headline(report: &DiffReport) -> &'static str {
    if report.partial.any() && report.first_divergence.is_none() {
        "PARTIAL"
    } else {
        verdict_word(report.verdict)
    }
}

/// Why a comparison with a partial trace cannot pass; None when both traces are complete.
pub(crate) fn partial_note(report: &DiffReport) -> Option<String> {
    report.partial.any().then(|| {
        format!(
            "the {} trace is partial (its run did not finish): only the {} stage records both hold are compared, and the verdict cannot be a pass",
            report.partial.sides(),
            report.stages.len()
        )
    })
}

/// `values` / `stats` / `ids`.
pub(crate) fn basis_word(b: Basis) -> &'static str {
    match b {
        Basis::Values => "values",
        Basis::Stats => "stats",
        Basis::Ids => "ids",
    }
}

/// A stage's error growth over its input's for tables: the factor, "made here" where the input
/// matched exactly, "-" where there is no earlier stage.
pub(crate) fn growth(amplification: Option<f64>) -> String {
    match amplification {
        None => "-".into(),
        Some(a) if a.is_infinite() => "made here".into(),
        Some(a) => num(a),
    }
}

/// A float in a short form for tables: `1.234e-4`, `0.0312`, `65504`, `inf`.
pub(crate) fn num(v: f64) -> String {
    let a = v.abs();
    if v == 0.0 {
        "0".into()
    } else if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.into()
    } else if !(1e-3..1e5).contains(&a) {
        format!("{v:.3e}")
    } else {
        format!("{v:.4}")
    }
}

/// A stage's name with its rank part: `L3.out`, `L3.attn.q @1`.
pub(crate) fn stage_label(s: &StageDiff) -> String {
    match s.rank {
        Some(r) => format!("{} @{r}", s.stage),
        None => s.stage.clone(),
    }
}

/// Whether `s` is the report's first divergence.
pub(crate) fn is_first(report: &DiffReport, s: &StageDiff) -> bool {
    report
        .first_divergence
        .as_ref()
        .is_some_and(|d| d.stage == s.stage && d.rank == s.rank)
}

/// One row of a per-layer summary: a contiguous run of stages of one layer (the stages before
/// the first layer and after the last form runs of their own).
pub(crate) struct LayerRow<'r> {
    pub layer: Option<u64>,
    pub stages: &'r [StageDiff],
    /// The run's largest `rel_diff` among value and stats stages.
    pub worst: &'r StageDiff,
    pub failed: bool,
    /// The run holds the first divergence.
    pub first: bool,
    /// The run's smallest cosine where values were compared.
    pub min_cosine: Option<f64>,
}

impl LayerRow<'_> {
    /// `3`, or the run's stage names for stages outside the layers.
    pub fn label(&self) -> String {
        match self.layer {
            Some(l) => l.to_string(),
            None => {
                let mut names: Vec<&str> = Vec::new();
                for s in self.stages {
                    if !names.contains(&s.stage.as_str()) {
                        names.push(&s.stage);
                    }
                }
                names.join(", ")
            }
        }
    }
}

/// The per-layer summary, in the report's stage order.
pub(crate) fn layer_rows(report: &DiffReport) -> Vec<LayerRow<'_>> {
    let stages = &report.stages;
    let mut rows = Vec::new();
    let mut start = 0;
    while start < stages.len() {
        let layer = stages[start].layer;
        let end = start
            + stages[start..]
                .iter()
                .take_while(|s| s.layer == layer)
                .count();
        let run = &stages[start..end];
        start = end;
        let Some(worst) = run
            .iter()
            .filter(|s| s.basis != Basis::Ids)
            .max_by(|a, b| a.rel_diff.total_cmp(&b.rel_diff))
        else {
            continue;
        };
        rows.push(LayerRow {
            layer,
            stages: run,
            worst,
            failed: run.iter().any(|s| s.status == Status::Fail),
            first: run.iter().any(|s| is_first(report, s)),
            min_cosine: run
                .iter()
                .filter_map(|s| s.metrics.as_ref().map(|m| m.cosine))
                .filter(|c| c.is_finite())
                .reduce(f64::min),
        });
    }
    rows
}

/// Indices of the stages worth a look: the two before and after the first divergence, and the
/// `worst` largest errors, in stage order.
pub(crate) fn notable_stages(report: &DiffReport, worst: usize) -> Vec<usize> {
    let mut rows: Vec<usize> = Vec::new();
    if let Some(i) = report.stages.iter().position(|s| is_first(report, s)) {
        rows.extend(i.saturating_sub(2)..(i + 3).min(report.stages.len()));
    }
    let mut by_error: Vec<usize> = (0..report.stages.len()).collect();
    by_error.sort_by(|&a, &b| {
        report.stages[b]
            .rel_diff
            .total_cmp(&report.stages[a].rel_diff)
    });
    rows.extend(by_error.into_iter().take(worst));
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Where an error sits between 1e-12 (0) and 1 (1) on a log scale.
pub(crate) fn log_level(rel_diff: f64) -> f64 {
    if rel_diff > 0.0 {
        ((rel_diff.log10() + 12.0) / 12.0).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(num(0.0), "0");
        assert_eq!(num(1.5e-7), "1.500e-7");
        assert_eq!(num(f64::INFINITY), "inf");
        assert_eq!(log_level(1.0), 1.0);
        assert_eq!(log_level(0.0), 0.0);
    }

    #[test]
    fn logits_sides_need_whole_rows() {
        assert!(LogitsSide::new(vec![0.0; 7], &[2, 4]).is_none());
        let s = LogitsSide::new(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 3]).unwrap();
        assert_eq!(
            (s.positions, s.vocab, s.row(1)),
            (2, 3, &[3.0f32, 4.0, 5.0][..])
        );
        let v = LogitsView::new(Some(s.clone()), Some(s)).unwrap();
        assert_eq!(v.comparison.unwrap().top1_agreement, 1.0);
        assert!(LogitsView::new(None, None).is_none());
    }
}
