//! Hybrid runs: the candidate and the reference each computing some of the blocks (the
//! embedding, each layer, the head), handing the hidden state over at a switch point.
//!
//! * `bisect --mode logits` judges a candidate by its logits alone, as an engine that exposes
//!   nothing else is: the candidate computing every block before a switch point, the reference
//!   the rest, a binary search finds the first block that breaks the logits in O(log L) runs.
//!   (With the roles the other way round it would find the last faulty block, and a loader bug
//!   that hits every layer would be blamed on the last layer instead of the first.)
//! * The replay at a first divergence: the reference computing the blocks before the divergent
//!   stage's block, the candidate from there — whether the stage still diverges on the
//!   reference's input (made there) or not (inherited from error below tolerance).

use std::path::Path;

use anyhow::Result;

use super::{reference_spec, BisectOptions, HybridRun, Replay, RunAs};
use crate::compare::classify::classify;
use crate::compare::diff::Divergence;
use crate::compare::{diff, DiffOptions, DiffReport, Fault, FaultClass, Status};
use crate::exec::ops::ties::TieBreaks;
use crate::model::stage::{layer_of, Stage};
use crate::model::Glm5Config;
use crate::pipeline::record::{record, RunSpec, Split};
use crate::pipeline::Model;
use crate::trace::Trace;

/// The output stage of block `b` and its layer.
pub fn block_stage(cfg: &Glm5Config, b: usize) -> (String, Option<u64>) {
    let layers = cfg.num_hidden_layers as usize;
    match b {
        b if b <= layers => (
            Stage::layer_input(b as u64).to_string(),
            b.checked_sub(1).map(|l| l as u64),
        ),
        _ => ("logits".into(), None),
    }
}

/// The last block on the candidate when the reference takes over at `switch`.
pub fn through(cfg: &Glm5Config, switch: usize) -> String {
    match switch {
        0 => "none".into(),
        s => block_stage(cfg, s - 1).0,
    }
}

/// The logits stage of a report.
pub fn logits_of(report: &DiffReport) -> Option<&crate::compare::StageDiff> {
    report
        .stages
        .iter()
        .find(|s| s.stage == "logits" && s.rank.is_none())
}

/// What hybrid runs need: the runs' settings, the reference and its envelope.
pub struct Hybrids<'a> {
    pub args: &'a BisectOptions,
    /// How the candidate runs.
    pub run_as: RunAs,
    pub tokens: &'a [u32],
    pub model: &'a Model,
    pub cand_model: &'a Model,
    pub dir: &'a Path,
    pub reference: &'a Trace,
    pub envelope: Option<&'a Trace>,
    pub ties: Option<&'a TieBreaks>,
}

/// The block that produces `stage` (None: the embedding, which has no input to replay from).
fn block_of(cfg: &Glm5Config, stage: &str) -> Option<usize> {
    match layer_of(stage) {
        Some(l) => Some(l as usize + 1),
        None if stage == "embed" => None,
        None => Some(cfg.num_hidden_layers as usize + 1),
    }
}

impl Hybrids<'_> {
    /// `reference` compared with the hybrid handing over at block `switch`.
    fn run(&self, switch: usize, reference_below: bool) -> Result<DiffReport> {
        let side = if reference_below { "replay" } else { "hybrid" };
        let out = self.dir.join(format!("{side}-{switch}.trace"));
        record(RunSpec {
            dtype: self.run_as.dtype,
            tp: self.run_as.tp,
            ep: self.run_as.ep,
            backend: self.run_as.backend,
            inject: self.run_as.inject,
            ties: self.ties,
            hybrid: Some(Split {
                reference: self.model,
                reference_backend: self.args.reference_backend,
                switch,
                reference_below,
            }),
            ..reference_spec(self.args, self.tokens, self.cand_model, &out)
        })?;
        let hybrid = Trace::open(&out)?;
        let opts = DiffOptions {
            tolerance: None,
            envelope: self.envelope,
        };
        diff(self.reference, &hybrid, &opts)
    }

    /// The divergent `stage` replayed from the reference's input to its block.
    pub fn replay(&self, cfg: &Glm5Config, stage: &str) -> Result<Option<Replay>> {
        let Some(block) = block_of(cfg, stage) else {
            return Ok(None);
        };
        let report = self.run(block, true)?;
        let Some(s) = report
            .stages
            .iter()
            .find(|s| s.stage == stage && s.rank.is_none())
        else {
            return Ok(None);
        };
        let from = match block {
            b if b > cfg.num_hidden_layers as usize => "final_norm".to_string(),
            b => format!("layer {}", b - 1),
        };
        Ok(Some(Replay {
            from,
            stage: stage.to_string(),
            status: s.status,
            rel_diff: s.rel_diff,
        }))
    }

    /// The logits of the hybrid handing over to the reference at block `switch`.
    fn logits_at(&self, cfg: &Glm5Config, switch: usize) -> Result<HybridRun> {
        let report = self.run(switch, false)?;
        let logits = logits_of(&report).ok_or_else(|| anyhow::anyhow!("no logits stage"))?;
        Ok(HybridRun {
            switch,
            candidate_through: through(cfg, switch),
            status: logits.status,
            rel_diff: logits.rel_diff,
        })
    }

    /// Given that the candidate's own logits fail (every block on it, switch L + 2) and the
    /// reference's pass (switch 0), the first switch point that fails: one past the first
    /// faulty block, which is returned.
    pub fn locate(&self, cfg: &Glm5Config, whole: HybridRun) -> Result<(usize, Vec<HybridRun>)> {
        let (mut lo, mut hi) = (0, cfg.num_hidden_layers as usize + 2);
        let mut runs = vec![whole];
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let run = self.logits_at(cfg, mid)?;
            if run.status == Status::Fail {
                hi = mid;
            } else {
                lo = mid;
            }
            runs.push(run);
        }
        Ok((hi - 1, runs))
    }

    /// Judge the candidate by `report`'s logits (already failed): locate the first faulty
    /// block, and give the report that divergence and what the logits show; the hybrid runs.
    pub fn locate_fault(
        &self,
        cfg: &Glm5Config,
        report: &mut DiffReport,
        candidate: &Trace,
        calibrated: bool,
    ) -> Result<Vec<HybridRun>> {
        let every_block = cfg.num_hidden_layers as usize + 2;
        let whole = logits_of(report).map(|s| HybridRun {
            switch: every_block,
            candidate_through: through(cfg, every_block),
            status: s.status,
            rel_diff: s.rel_diff,
        });
        let (block, runs) = self.locate(
            cfg,
            whole.ok_or_else(|| anyhow::anyhow!("no logits stage"))?,
        )?;
        let (stage, layer) = block_stage(cfg, block);
        // What the logits alone show (flat, NaN, overflow), with where the search put it.
        let traced = classify(self.reference, candidate, &report.stages, 0, calibrated)?;
        let located =
            format!("the logits break once the block ending at {stage} runs on the candidate");
        let (class, summary) = match traced.class {
            FaultClass::Unknown | FaultClass::PrecisionLoss => (FaultClass::Unknown, located),
            class => (class, format!("{}; {located}", traced.summary)),
        };
        let mut evidence = traced.evidence;
        evidence.extend(runs.iter().map(|r| {
            format!(
                "candidate through {}, the reference after: logits {} (rel_diff {:.3e})",
                r.candidate_through,
                if r.status == Status::Fail {
                    "fail"
                } else {
                    "pass"
                },
                r.rel_diff
            )
        }));
        report.fault = Some(Fault {
            class,
            summary,
            evidence,
            weight: None,
        });
        report.first_divergence = Some(Divergence {
            stage,
            layer,
            rank: None,
        });
        Ok(runs)
    }
}
