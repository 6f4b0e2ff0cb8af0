//! A candidate trace against a baseline: the run's settings first (another model, dtype, TP or
//! prompt is a wrong comparison, an input error), then every stage record's statistics against
//! the baseline's limits, then the logits position by position.

use anyhow::{bail, Result};
use serde::Serialize;

use super::baseline::{logits_rows, run_ep, Baseline, StageBaseline};
use crate::compare::stage_diff::whole_values;
use crate::compare::Status;
use crate::model::stage::is_gaps;
use crate::trace::{ElemType, StageRecord, TensorStats, Trace};

/// The name of the pseudo-stage holding the per-position logits checks.
pub const LOGITS_POSITIONS: &str = "logits (per position)";

/// One statistic outside its limit.
#[derive(Clone, Debug, Serialize)]
pub struct Broken {
    /// `mean`, `nan`, `ids`, `top1[3]`, `missing`…
    pub check: String,
    pub baseline: Option<f64>,
    pub candidate: Option<f64>,
    /// The largest |candidate − baseline| that passes (for counts: the largest growth).
    pub limit: Option<f64>,
    /// What the numbers mean, in words.
    pub why: String,
}

/// How a stage was judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Basis {
    /// Equal content hashes: the same values bit for bit.
    Identical,
    /// Statistics against ε-limits.
    Stats,
    /// Top-k id sets (their statistics must be equal).
    Ids,
    /// A near tie of the baseline's run: not judged.
    NearTie,
    /// Per-position logits.
    Positions,
    /// The candidate lacks the stage, or holds it in another shape or type.
    Missing,
    /// The candidate's run did not finish: its trace is partial.
    Unfinished,
}

/// One stage record (or the per-position logits) judged.
#[derive(Clone, Debug, Serialize)]
pub struct StageResult {
    pub stage: String,
    pub rank: Option<u32>,
    pub status: Status,
    pub basis: Basis,
    /// The largest |Δ| / limit over the stage's statistics (≤ 1 passes): how close it came.
    pub headroom_used: f64,
    /// The statistic that came closest.
    pub closest: Option<String>,
    pub epsilon: f64,
    pub failures: Vec<Broken>,
}

impl StageResult {
    pub fn label(&self) -> String {
        match self.rank {
            Some(r) => format!("{} @{r}", self.stage),
            None => self.stage.clone(),
        }
    }
}

/// The gate's verdict.
#[derive(Clone, Debug, Serialize)]
pub struct GateReport {
    pub verdict: Status,
    pub baseline: String,
    pub candidate: String,
    pub dtype: String,
    pub tp: u32,
    pub epsilon: f64,
    /// Stage records judged (plus the per-position logits).
    pub checked: usize,
    /// Of them, how many broke.
    pub failed: usize,
    /// Stages the candidate has beyond the baseline's (not judged).
    pub extra_stages: usize,
    /// The candidate is a partial trace (its run did not finish): the stages it holds are
    /// judged, the record [`PARTIAL_RECORD`] fails, and the verdict is never a pass.
    pub partial: bool,
    /// Baseline stage records a partial candidate never reached (not judged).
    pub not_reached: usize,
    /// Near ties of the baseline's run that were not judged, and the like.
    pub notes: Vec<String>,
    pub stages: Vec<StageResult>,
}

/// The name of the failing record that stands for a partial candidate's unfinished run.
pub const PARTIAL_RECORD: &str = "trace";

impl GateReport {
    pub fn failures(&self) -> impl Iterator<Item = &StageResult> {
        self.stages.iter().filter(|s| s.status == Status::Fail)
    }

    /// Whether a stage the candidate holds broke its limits (beyond a partial trace's record).
    pub fn regressed(&self) -> bool {
        self.failures().any(|s| s.basis != Basis::Unfinished)
    }
}

/// The candidate's run must be the baseline's: the same weights, dtype, TP, EP, prompt and
/// latent-norm eps. Anything else is a wrong comparison (an input error), not a regression.
pub fn check_config(baseline: &Baseline, candidate: &Trace) -> Result<()> {
    let m = candidate.manifest();
    let cand = candidate.dir().display();
    let wrong = "a wrong comparison, not a regression";
    if m.model.fingerprint != baseline.model.fingerprint {
        bail!(
            "{cand}: model fingerprint {} differs from the baseline's {} (another model's weights: {wrong})",
            show(&m.model.fingerprint),
            show(&baseline.model.fingerprint)
        );
    }
    if m.dtype != baseline.dtype {
        bail!(
            "{cand}: dtype {} differs from the baseline's {} ({wrong})",
            m.dtype,
            baseline.dtype
        );
    }
    if m.tp != baseline.tp {
        bail!(
            "{cand}: tp {} differs from the baseline's {} ({wrong})",
            m.tp,
            baseline.tp
        );
    }
    if run_ep(&m.producer) != baseline.ep {
        bail!(
            "{cand}: ep {} differs from the baseline's {} ({wrong})",
            run_ep(&m.producer),
            baseline.ep
        );
    }
    if m.tokens != baseline.tokens {
        let at = m
            .tokens
            .iter()
            .zip(&baseline.tokens)
            .position(|(a, b)| a != b)
            .unwrap_or(m.tokens.len().min(baseline.tokens.len()));
        bail!(
            "{cand}: prompt tokens differ from the baseline's ({} against {} tokens, first difference at position {at}; {wrong})",
            m.tokens.len(),
            baseline.tokens.len()
        );
    }
    let eps = m.producer.get("latent_norm_eps").and_then(|v| v.as_f64());
    if let (Some(c), Some(b)) = (eps, baseline.latent_norm_eps()) {
        if c != b {
            bail!("{cand}: latent_norm_eps {c:e} differs from the baseline's {b:e} ({wrong})");
        }
    }
    Ok(())
}

fn show(fingerprint: &str) -> String {
    if fingerprint.is_empty() {
        "(none)".into()
    } else {
        fingerprint.to_string()
    }
}

/// Judge `candidate` against `baseline` (after [`check_config`]).
pub fn check(baseline: &Baseline, candidate: &Trace, baseline_path: &str) -> Result<GateReport> {
    check_config(baseline, candidate)?;
    let partial = !candidate.manifest().complete;
    let mut stages = Vec::new();
    let mut notes = Vec::new();
    let mut not_reached = 0;
    for b in &baseline.stages {
        let eps = baseline.epsilon(b);
        let result = match candidate.stage(&b.name, b.rank) {
            None if partial => {
                not_reached += 1;
                continue;
            }
            None => missing(b, eps, "the candidate does not record this stage".into()),
            Some(c) if c.shape != b.shape || c.dtype != b.dtype => missing(
                b,
                eps,
                format!(
                    "the candidate records it as {:?} {:?}, the baseline as {:?} {:?}",
                    c.dtype, c.shape, b.dtype, b.shape
                ),
            ),
            Some(c) => judge(b, c, eps, &mut notes),
        };
        stages.push(result);
    }
    let reached_logits = candidate.stages().iter().any(|s| s.name == "logits");
    match &baseline.logits {
        Some(l) if reached_logits || !partial => {
            stages.push(judge_logits(baseline, l, candidate, &mut notes)?)
        }
        Some(_) => not_reached += 1,
        None => {}
    }
    if partial {
        stages.push(unfinished(candidate, not_reached, baseline.limits.epsilon));
    }
    let known: std::collections::HashSet<(&str, Option<u32>)> = baseline
        .stages
        .iter()
        .map(|s| (s.name.as_str(), s.rank))
        .collect();
    let extra_stages = candidate
        .stages()
        .iter()
        .filter(|s| !is_gaps(&s.name) && !known.contains(&(s.name.as_str(), s.rank)))
        .count();
    let failed = stages.iter().filter(|s| s.status == Status::Fail).count();
    Ok(GateReport {
        verdict: if failed > 0 {
            Status::Fail
        } else {
            Status::Pass
        },
        baseline: baseline_path.to_string(),
        candidate: candidate.dir().display().to_string(),
        dtype: baseline.dtype.clone(),
        tp: baseline.tp,
        epsilon: baseline.limits.epsilon,
        checked: stages.len(),
        failed,
        extra_stages,
        partial,
        not_reached,
        notes,
        stages,
    })
}

/// The failing record of a partial candidate: what it did not reach.
fn unfinished(candidate: &Trace, not_reached: usize, eps: f64) -> StageResult {
    StageResult {
        stage: PARTIAL_RECORD.into(),
        rank: None,
        status: Status::Fail,
        basis: Basis::Unfinished,
        headroom_used: f64::INFINITY,
        closest: None,
        epsilon: eps,
        failures: vec![Broken {
            check: "complete".into(),
            baseline: None,
            candidate: None,
            limit: None,
            why: format!(
                "{} is a partial trace (its run did not finish): {not_reached} baseline records not reached, not judged",
                candidate.dir().display()
            ),
        }],
    }
}

fn missing(b: &StageBaseline, eps: f64, why: String) -> StageResult {
    StageResult {
        stage: b.name.clone(),
        rank: b.rank,
        status: Status::Fail,
        basis: Basis::Missing,
        headroom_used: f64::INFINITY,
        closest: None,
        epsilon: eps,
        failures: vec![Broken {
            check: "missing".into(),
            baseline: None,
            candidate: None,
            limit: None,
            why,
        }],
    }
}

/// Collects checks of one stage: the failures and the check closest to its limit.
struct Judge {
    failures: Vec<Broken>,
    worst: f64,
    closest: Option<String>,
}

impl Judge {
    fn new() -> Judge {
        Judge {
            failures: Vec::new(),
            worst: 0.0,
            closest: None,
        }
    }

    /// `|c − b| ≤ limit`.
    fn within(&mut self, check: &str, b: f64, c: f64, limit: f64, what: &str) {
        let delta = (c - b).abs();
        let used = if delta == 0.0 {
            0.0
        } else if limit > 0.0 {
            delta / limit
        } else {
            f64::INFINITY
        };
        // A NaN statistic (never written by glmcheck) breaks any limit.
        let used = if used.is_nan() { f64::INFINITY } else { used };
        if used > self.worst || self.closest.is_none() {
            self.worst = self.worst.max(used);
            self.closest = Some(check.to_string());
        }
        if used > 1.0 {
            self.failures.push(Broken {
                check: check.into(),
                baseline: Some(b),
                candidate: Some(c),
                limit: Some(limit),
                why: format!("|Δ| = {delta:.3e} > {limit:.3e} ({what})"),
            });
        }
    }

    /// A count that must not grow by more than `slack`.
    fn not_grown(&mut self, check: &str, b: u64, c: u64, slack: u64, what: &str) {
        let grown = c.saturating_sub(b);
        let used = if grown == 0 {
            0.0
        } else if slack > 0 {
            grown as f64 / slack as f64
        } else {
            f64::INFINITY
        };
        if used > self.worst {
            self.worst = used;
            self.closest = Some(check.to_string());
        }
        if grown > slack {
            self.failures.push(Broken {
                check: check.into(),
                baseline: Some(b as f64),
                candidate: Some(c as f64),
                limit: Some(slack as f64),
                why: format!("{grown} more ({what})"),
            });
        }
    }

    fn fail(&mut self, check: &str, b: Option<f64>, c: Option<f64>, why: String) {
        self.worst = f64::INFINITY;
        self.closest = Some(check.to_string());
        self.failures.push(Broken {
            check: check.into(),
            baseline: b,
            candidate: c,
            limit: None,
            why,
        });
    }

    fn result(self, b: &StageBaseline, basis: Basis, eps: f64) -> StageResult {
        StageResult {
            stage: b.name.clone(),
            rank: b.rank,
            status: if self.failures.is_empty() {
                Status::Pass
            } else {
                Status::Fail
            },
            basis,
            headroom_used: self.worst,
            closest: self.closest,
            epsilon: eps,
            failures: self.failures,
        }
    }
}

/// Every statistic of an id multiset, compared exactly (`std` to 1e-12: its two passes may
/// round differently when the ids come in another order).
fn same_ids(b: &TensorStats, c: &TensorStats) -> Option<&'static str> {
    if b.count != c.count {
        return Some("count");
    }
    for (what, x, y) in [
        ("mean", b.mean, c.mean),
        ("min", b.min, c.min),
        ("max", b.max, c.max),
        ("l2", b.l2, c.l2),
    ] {
        if x != y {
            return Some(what);
        }
    }
    if (b.std - c.std).abs() > 1e-12 * b.std.max(1.0) {
        return Some("std");
    }
    None
}

fn judge(b: &StageBaseline, c: &StageRecord, eps: f64, notes: &mut Vec<String>) -> StageResult {
    let (bs, cs) = (&b.stats, &c.stats);
    let mut j = Judge::new();
    if bs.hash == cs.hash {
        return j.result(b, Basis::Identical, eps);
    }
    j.not_grown("nan", bs.nan, cs.nan, 0, "NaN must not appear");
    j.not_grown("inf", bs.inf, cs.inf, 0, "Inf must not appear");
    if b.dtype == ElemType::I32 {
        let judged = b.ids_judged(eps);
        if let Some(what) = same_ids(bs, cs) {
            if judged {
                let (x, y) = match what {
                    "count" => (bs.count as f64, cs.count as f64),
                    "mean" => (bs.mean, cs.mean),
                    "min" => (bs.min, cs.min),
                    "max" => (bs.max, cs.max),
                    "l2" => (bs.l2, cs.l2),
                    _ => (bs.std, cs.std),
                };
                j.fail(
                    &format!("ids ({what})"),
                    Some(x),
                    Some(y),
                    "other ids chosen: the sets' statistics differ".into(),
                );
            } else {
                notes.push(format!(
                    "{}: other ids than the baseline's, not judged: the baseline's smallest top-k gap is {:.2e} of the largest (≤ ε = {eps:.2e}), a near tie",
                    b.label(),
                    b.min_gap_ratio.unwrap_or(0.0)
                ));
                return j.result(b, Basis::NearTie, eps);
            }
        }
        return j.result(b, Basis::Ids, eps);
    }
    let finite = bs.count - bs.nan - bs.inf;
    let rms = if finite > 0 {
        bs.l2 / (finite as f64).sqrt()
    } else {
        0.0
    };
    j.within("l2", bs.l2, cs.l2, eps * bs.l2, "ε·l2");
    j.within("mean", bs.mean, cs.mean, eps * rms, "ε·rms");
    j.within("std", bs.std, cs.std, eps * rms, "ε·rms");
    j.within("min", bs.min, cs.min, eps * bs.absmax, "ε·absmax");
    j.within("max", bs.max, cs.max, eps * bs.absmax, "ε·absmax");
    j.within("absmax", bs.absmax, cs.absmax, eps * bs.absmax, "ε·absmax");
    let slack = ((eps * bs.count as f64).ceil() as u64).max(1);
    j.not_grown(
        "zeros",
        bs.zeros,
        cs.zeros,
        slack,
        "max(1, ε·count) exact zeros",
    );
    j.result(b, Basis::Stats, eps)
}

/// The logits position by position: the same top-1 token (unless the baseline's margin is
/// within 2ε of the row's largest |logit|: two logits each moving by ε·absmax may swap), an
/// entropy within its first-order bound `2·H·ε·absmax` (a logit change of at most δ moves the
/// entropy by at most `2·H·δ`), and not flat where the baseline is not.
fn judge_logits(
    baseline: &Baseline,
    l: &super::baseline::LogitsBaseline,
    candidate: &Trace,
    notes: &mut Vec<String>,
) -> Result<StageResult> {
    let eps = baseline
        .stages
        .iter()
        .find(|s| s.name == "logits" && s.rank.is_none())
        .map_or(baseline.limits.epsilon, |s| baseline.epsilon(s));
    let holder = StageBaseline {
        name: LOGITS_POSITIONS.into(),
        rank: None,
        shape: vec![l.positions as u64, l.vocab as u64],
        dtype: ElemType::F32,
        dims: "t v".into(),
        stats: TensorStats::of::<f32>(&[]),
        min_gap_ratio: None,
        near_ties: Vec::new(),
        epsilon: None,
    };
    let values = match candidate.stages().iter().any(|s| s.name == "logits") {
        true => whole_values(candidate, "logits")?,
        false => None,
    };
    let Some((values, shape)) = values else {
        bail!(
            "{}: stage \"logits\" holds no values, and the baseline judges the logits position by position (record them in full: `--full logits`)",
            candidate.dir().display()
        );
    };
    let mut j = Judge::new();
    let vocab = shape.last().copied().unwrap_or(0) as usize;
    let positions = values.len().checked_div(vocab).unwrap_or(0);
    if vocab != l.vocab || positions != l.positions {
        j.fail(
            "shape",
            None,
            None,
            format!(
                "{positions} positions × vocab {vocab}; the baseline has {} × {}",
                l.positions, l.vocab
            ),
        );
        return Ok(j.result(&holder, Basis::Missing, eps));
    }
    let c = logits_rows(&values, vocab);
    let mut ties = Vec::new();
    for p in 0..l.positions {
        let tie_margin = 2.0 * eps * l.absmax[p];
        if c.top1[p] != l.top1[p] {
            if l.margin[p] <= tie_margin {
                ties.push(p);
            } else {
                j.fail(
                    &format!("top1[{p}]"),
                    Some(f64::from(l.top1[p])),
                    Some(f64::from(c.top1[p])),
                    format!(
                        "top-1 token {} instead of {} at position {p} (baseline margin {:.3e} > 2ε·absmax = {tie_margin:.3e})",
                        c.top1[p], l.top1[p], l.margin[p]
                    ),
                );
            }
        }
        let limit = 2.0 * l.entropy[p] * eps * l.absmax[p];
        j.within(
            &format!("entropy[{p}]"),
            l.entropy[p],
            c.entropy[p],
            limit,
            "2·H·ε·absmax",
        );
    }
    if c.flat && !l.flat {
        j.fail(
            "flat",
            Some(l.entropy_mean),
            Some(c.entropy_mean),
            format!(
                "flat logits: mean entropy {:.4} ≥ 0.9·ln V = {:.4}, the baseline's is {:.4}",
                c.entropy_mean,
                0.9 * (vocab as f64).ln(),
                l.entropy_mean
            ),
        );
    }
    if !ties.is_empty() {
        notes.push(format!(
            "logits: another top-1 at positions {ties:?}, not judged: the baseline's margin there is within 2ε of the largest |logit| (a near tie)"
        ));
    }
    Ok(j.result(&holder, Basis::Positions, eps))
}
