//! `glmcheck bisect MODEL`: the one-shot diagnosis. Runs the reference (MODEL on the CPU, TP 1,
//! f32) and the candidate (MODEL at the given TP, dtype and planted fault, or an engine's trace),
//! compares them stage by stage — against the reference re-run at the candidate's dtype as the
//! noise envelope, with near ties at top-k boundaries resolved as the reference resolved them —
//! then drills down at the first divergence (the weights that stage reads and each rank's
//! shard of them) and names the faulty step with its evidence.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde::Serialize;

mod gguf_meta;
mod hybrid;
mod weights;

use super::diff::print_report;
use super::output::{progress, table};
use super::run::{open_model, prompt_tokens, record, RunSpec};
use super::Outcome;
use crate::compare::{diff, DiffOptions, DiffReport, Fault, FaultClass, Status};
use crate::diagnose::{check_shards, drill_down, CandidateRun};
use crate::exec::backend::Precision;
use crate::exec::engine::BackendKind;
use crate::exec::forward::HF_LATENT_NORM_EPS;
use crate::exec::inject::{Injection, CATALOGUE};
use crate::exec::source::WeightSource;
use crate::exec::ties::TieBreaks;
use crate::exec::tokenize;
use crate::model::names::WeightId;
use crate::model::stages::{layer_weights, stage_weights, weights_up_to};
use crate::model::Glm5Config;
use crate::shard::actual::{check_only, ShardManifest};
use crate::trace::{FullSelector, Trace};
use hybrid::{logits_of, HybridRun, Hybrids, Replay};
pub use weights::{WeightCheck, WeightsInfo};

/// The prompt when none is given.
pub const DEFAULT_PROMPT: &str = "The capital of France is";

#[derive(clap::Args, Debug)]
pub struct BisectArgs {
    /// A GLM-5 GGUF or Hugging Face folder: the reference, and the candidate unless
    /// `--candidate` names another.
    #[arg(required_unless_present = "list_faults")]
    pub model: Option<PathBuf>,
    /// The candidate's tensor-parallel degree (vLLM's split, ranks on the CPU).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: u64,
    /// The candidate with expert parallelism: routed experts whole on their owning rank.
    #[arg(long)]
    pub ep: bool,
    /// Where the candidate's ops run: `cpu`, or `cuda` (one GPU per rank, cuBLAS, NCCL); the
    /// reference always runs on the CPU.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// The candidate's dtype; bf16/f16 are judged against the reference re-run at that dtype.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Precision,
    /// Plant a fault in the candidate (`--list-faults`), as `NAME[=ARG]`.
    #[arg(long, value_name = "FAULT[=ARG]", value_parser = Injection::parse)]
    pub inject: Option<Injection>,
    /// The candidate: another MODEL (a conversion of the reference: HF folder against its GGUF)
    /// run with the options above, or a TRACE an engine probe wrote (then the prompt is the
    /// trace's tokens).
    #[arg(long, value_name = "MODEL|TRACE")]
    pub candidate: Option<PathBuf>,
    /// Prompt text (default "The capital of France is"), through the model's tokenizer.
    #[arg(long, conflicts_with = "tokens")]
    pub prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Vec<u32>,
    /// Greedy tokens generated after the prompt on both sides, to show what each prints.
    #[arg(long, default_value_t = 8)]
    pub generate: usize,
    /// Eps of the q_a/kv_a RMSNorms on both sides (transformers 1e-6; vLLM, llama.cpp
    /// `rms_norm_eps`).
    #[arg(long, default_value_t = HF_LATENT_NORM_EPS)]
    pub latent_norm_eps: f64,
    /// An engine's shard manifest (the format `glmcheck shards --actual` reads): at the first
    /// divergence, each rank's shards of the weights that stage reads are checked against the
    /// plan — the drill-down for an engine's `--candidate TRACE`.
    #[arg(long, value_name = "MANIFEST")]
    pub actual: Option<PathBuf>,
    /// Keep the traces in this folder (reference.trace, envelope.trace, candidate.trace);
    /// default: a temporary folder, removed after.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// A conversion's weights checked as `glmcheck verify` checks them (a corrupted tensor fails
    /// the run even inside the envelope): `all` before the runs, `divergent` only those the first
    /// divergent stage reads, `auto` all up to 32 GiB of candidate files, else divergent.
    #[arg(long, value_enum, default_value = "auto")]
    pub weights: WeightCheck,
    /// List the fault catalogue (name, ARG, class and stage a correct diagnosis gives).
    #[arg(long)]
    pub list_faults: bool,
    /// `stages`: compare every stage both sides record. `logits`: judge the candidate by its
    /// logits alone, as an engine exposing nothing else, and find the first faulty layer by
    /// hybrid runs (the candidate up to a layer, the reference after it; O(log L) runs).
    #[arg(long, value_enum, default_value = "stages")]
    pub mode: Mode,
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// What the candidate is judged by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Stages,
    Logits,
}

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
    /// weight check), `shard manifest`, `gguf metadata` (what an engine's trace says it read)
    /// or `traces`.
    pub classified_by: &'static str,
    /// A conversion's weight check (`--weights`): what was checked and found.
    pub weights: Option<WeightsInfo>,
    /// `--mode logits`: the hybrid runs of the search, in the order they ran.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hybrids: Vec<HybridRun>,
    /// The first divergent stage re-run on the candidate from the reference's input to its
    /// block: made there (`fail`) or inherited (`pass`).
    pub replay: Option<Replay>,
    pub reference_text: Option<String>,
    pub candidate_text: Option<String>,
}

fn list_faults(json: bool) -> anyhow::Result<Outcome> {
    if json {
        println!("{}", serde_json::to_string_pretty(CATALOGUE)?);
        return Ok(Outcome::Pass);
    }
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
    println!("{t}");
    println!(
        "\nnamed from the GGUF metadata an engine trace records (llama.cpp probe), not planted:"
    );
    let mut t = table(&["GGUF key", "class", "first divergence", "what"]);
    for k in &gguf_meta::KEYS {
        t.add_row(vec![
            format!("<arch>.{}", k.key),
            k.class.name().to_string(),
            k.stages.join(" or "),
            k.does.to_string(),
        ]);
    }
    println!("{t}");
    Ok(Outcome::Pass)
}

/// A trace folder holds `manifest.json`.
fn is_trace(p: &Path) -> bool {
    p.join("manifest.json").is_file()
}

pub fn run(args: BisectArgs) -> anyhow::Result<Outcome> {
    if args.list_faults {
        return list_faults(args.json);
    }
    let out = bisect(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_bisect(&out);
    }
    Ok(match out.diff.verdict {
        Status::Pass => Outcome::Pass,
        Status::Fail => Outcome::Fail,
    })
}

/// Run both sides, compare, drill down.
pub fn bisect(args: &BisectArgs) -> anyhow::Result<BisectReport> {
    let model = args.model.clone().context("MODEL is required")?;
    let engine_trace = args.candidate.as_deref().filter(|p| is_trace(p));
    if engine_trace.is_some() && args.inject.is_some() {
        bail!("--inject plants a fault in a run glmcheck makes; --candidate TRACE is an engine's");
    }
    if engine_trace.is_some() && args.mode == Mode::Logits {
        bail!("--mode logits bisects with hybrid runs: the candidate is a MODEL, not a TRACE");
    }
    let (files, cfg, _) = open_model(&model)?;
    let prompt_text = match (&args.prompt, args.tokens.is_empty(), engine_trace) {
        (_, _, Some(_)) => None,
        (Some(p), _, _) => Some(p.clone()),
        (None, true, _) => Some(DEFAULT_PROMPT.to_string()),
        (None, false, _) => None,
    };
    let (mut tokens, tokenizer) = prompt_tokens(&files, prompt_text.as_deref(), &args.tokens)
        .or_else(|e| match &prompt_text {
            Some(_) => Err(e),
            None => Ok((vec![0], None)),
        })?;
    let engine = engine_trace
        .map(|p| Trace::open(p).with_context(|| p.display().to_string()))
        .transpose()?;
    if let Some(t) = &engine {
        tokens = t.manifest().tokens.clone();
    }
    let scratch = tempfile::tempdir()?;
    let dir = args.out.as_deref().unwrap_or(scratch.path());
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    let cand_model = args.candidate.clone().unwrap_or_else(|| model.clone());
    // A conversion (another model's files) is judged against the reference with every weight
    // stored as the candidate stores it: its quantization noise is not a fault.
    let conversion = engine.is_none() && cand_model != model;
    // An engine's trace of a quantized GGUF is judged the same way, against that file's types.
    let engine_gguf = engine
        .as_ref()
        .and_then(|t| gguf_meta::quantized_source(&t.manifest().model));
    let stored_as = match conversion {
        true => Some(cand_model.as_path()),
        false => engine_gguf.as_deref(),
    };
    // An engine's trace says its dtype; the envelope is the reference run at it.
    let dtype = match &engine {
        Some(t) => Precision::from_name(&t.manifest().dtype)
            .with_context(|| format!("{}: dtype", t.dir().display()))?,
        None => args.dtype,
    };
    let lower = stored_as.is_some() || !matches!(dtype, Precision::F32 | Precision::F64);
    let check_all = conversion && {
        let (files, cfg, family) = open_model(&cand_model)?;
        weights::check_all(args.weights, &WeightSource::new(files, cfg, family))
    };
    let steps = 3 + u64::from(lower) + u64::from(check_all);
    let bar = progress(steps, args.json, "bisect");
    let mut weight_check = None;
    if check_all {
        bar.set_message("weight check: every candidate tensor against the reference");
        weight_check = Some(weights::check_every_tensor(&model, &cand_model)?);
        bar.inc(1);
    }
    let paths = ["reference", "envelope", "candidate"].map(|n| dir.join(format!("{n}.trace")));
    bar.set_message("reference run (CPU, TP 1, f32)");
    let ref_run = record(reference_spec(args, &tokens, &model, &paths[0]))?;
    bar.inc(1);
    let reference = Trace::open(&paths[0])?;
    let ties = if lower {
        TieBreaks::from_trace(&reference)?
    } else {
        TieBreaks::default()
    };
    let envelope = if lower {
        bar.set_message(format!("envelope run (CPU, TP 1, {})", dtype.name()));
        record(RunSpec {
            dtype,
            ties: Some(&ties),
            stored_as,
            ..reference_spec(args, &tokens, &model, &paths[1])
        })?;
        bar.inc(1);
        Some(Trace::open(&paths[1])?)
    } else {
        None
    };
    // The candidate also takes the reference's choice where a gap is within the envelope's noise.
    let ties = match &envelope {
        Some(env) => TieBreaks::from_traces(&reference, Some(env))?,
        None => ties,
    };
    // An engine breaks near ties its own way, and every later stage follows its choice: there
    // the reference and the envelope are run again taking the engine's choice, at exactly the
    // positions where the reference's own gap was a near tie. Following one choice may bring
    // the run to another near tie further on, so this repeats (a few rounds at most).
    let mut ties_followed = 0;
    let (mut reference, mut envelope) = (reference, envelope);
    if let (Some(t), true) = (&engine, lower && envelope.is_some()) {
        let mut near = ties.clone();
        let mut followed = TieBreaks::default();
        for round in 0..FOLLOW_ROUNDS {
            let theirs = near.chosen_by(t)?;
            let flipped = near.differing(&theirs);
            if flipped == 0 {
                break;
            }
            ties_followed += flipped;
            followed.absorb(&theirs);
            bar.set_message("reference and envelope again, with the engine's near-tie choices");
            let [r, e] = [
                format!("reference-ties{round}"),
                format!("envelope-ties{round}"),
            ]
            .map(|n| dir.join(format!("{n}.trace")));
            record(RunSpec {
                ties: Some(&followed),
                ..reference_spec(args, &tokens, &model, &r)
            })?;
            record(RunSpec {
                dtype,
                ties: Some(&followed),
                stored_as,
                ..reference_spec(args, &tokens, &model, &e)
            })?;
            reference = Trace::open(&r)?;
            let env = Trace::open(&e)?;
            near = TieBreaks::from_traces(&reference, Some(&env))?;
            near.absorb(&followed);
            envelope = Some(env);
        }
    }
    let (candidate, cand_run) = match engine {
        Some(t) => (t, None),
        None => {
            bar.set_message(format!(
                "candidate run (TP {}, {}{})",
                args.tp,
                args.dtype.name(),
                args.inject
                    .map(|f| format!(", {}", f.spec()))
                    .unwrap_or_default()
            ));
            let ties = lower.then_some(&ties);
            let run = record(RunSpec {
                dtype: args.dtype,
                tp: args.tp,
                ep: args.ep,
                backend: args.backend,
                inject: args.inject,
                ties,
                ..reference_spec(args, &tokens, &cand_model, &paths[2])
            })?;
            (Trace::open(&paths[2])?, Some(run))
        }
    };
    bar.inc(1);
    bar.set_message("compare and drill down");
    let opts = DiffOptions {
        tolerance: None,
        envelope: envelope.as_ref(),
    };
    let mut report = diff(&reference, &candidate, &opts)?;
    let runs = Hybrids {
        args,
        tokens: &tokens,
        model: &model,
        cand_model: &cand_model,
        dir,
        reference: &reference,
        envelope: envelope.as_ref(),
        ties: lower.then_some(&ties),
    };
    let mut hybrids = Vec::new();
    let mut replay = None;
    match (args.mode, cand_run.is_some()) {
        (Mode::Logits, _) => {
            report = logits_view(report)?;
            if report.verdict == Status::Fail {
                bar.set_message("hybrid runs: the candidate up to a layer, the reference after it");
                hybrids = runs.locate_fault(&cfg, &mut report, &candidate, lower)?;
            }
        }
        (Mode::Stages, true) => {
            if let Some(d) = &report.first_divergence {
                bar.set_message("replay from the reference's input");
                replay = runs.replay(&cfg, &d.stage)?;
            }
        }
        (Mode::Stages, false) => {}
    }
    let cause = Cause {
        args,
        model: &model,
        cand_model: &cand_model,
        cfg: &cfg,
        candidate: &candidate,
        glmcheck_ran: cand_run.is_some(),
    };
    let mut classified_by = cause.explain(&mut report)?;
    if cand_run.is_none() && args.mode == Mode::Stages {
        if let Some(by) = engine_cause(
            args,
            &model,
            &cfg,
            &candidate,
            &mut report,
            &mut weight_check,
        )? {
            classified_by = by;
        }
    }
    if conversion && args.weights != WeightCheck::Off {
        if let (None, Some(d)) = (&weight_check, &report.first_divergence) {
            bar.set_message("weight check: the divergent stage's tensors");
            let ids = match (args.mode, d.layer) {
                (Mode::Logits, Some(l)) => layer_weights(&cfg, l),
                _ => stage_weights(&cfg, &d.stage),
            };
            weight_check = Some(weights::check_tensors_of(&model, &cand_model, &ids)?);
        }
        if let Some(info) = &weight_check {
            if weights::apply(&mut report, info, &model, &cand_model, merge)? {
                classified_by = "weights";
            }
        }
    }
    if let (Some(f), Some(r)) = (&mut report.fault, &replay) {
        f.evidence.push(r.evidence());
    }
    bar.inc(1);
    bar.finish_and_clear();
    let text = |ids: &[u32]| -> anyhow::Result<Option<String>> {
        match &tokenizer {
            Some(tok) if !ids.is_empty() => Ok(Some(tokenize::decode(tok, ids)?)),
            _ => Ok(None),
        }
    };
    let out = BisectReport {
        bisect: BisectInfo {
            model: model.display().to_string(),
            prompt: prompt_text,
            candidate: args
                .candidate
                .as_ref()
                .map_or_else(|| model.display().to_string(), |c| c.display().to_string()),
            backend: if cand_run.is_some() {
                args.backend.name().to_string()
            } else {
                candidate.manifest().backend.clone()
            },
            tp: if cand_run.is_some() {
                args.tp
            } else {
                u64::from(candidate.manifest().tp)
            },
            dtype: dtype.name().into(),
            inject: args.inject.map(|f| f.spec()),
            envelope: envelope.as_ref().map(|e| e.dir().display().to_string()),
            conversion: stored_as.is_some(),
            ties_taken: if lower && cand_run.is_some() {
                ties.count()
            } else {
                0
            },
            ties_followed,
            classified_by,
            weights: weight_check,
            hybrids,
            replay,
            reference_text: text(&ref_run.generated)?,
            candidate_text: match &cand_run {
                Some(r) => text(&r.generated)?,
                None => None,
            },
        },
        diff: report,
    };
    Ok(out)
}

/// Rounds of re-running the reference with an engine's near-tie choices: each may reach a near
/// tie further on that the engine also broke its own way.
const FOLLOW_ROUNDS: usize = 3;

/// What explains a first divergence beyond the traces: the weights and shards behind it (when
/// glmcheck ran the candidate), and an engine's shard manifest (`--actual`).
struct Cause<'a> {
    args: &'a BisectArgs,
    model: &'a Path,
    cand_model: &'a Path,
    cfg: &'a Glm5Config,
    candidate: &'a Trace,
    glmcheck_ran: bool,
}

impl Cause<'_> {
    /// Give `report` the cause found, if any; where its class came from.
    fn explain(&self, report: &mut DiffReport) -> anyhow::Result<&'static str> {
        let Some(d) = report.first_divergence.clone() else {
            return Ok("traces");
        };
        // In logits mode the divergence is a whole layer.
        let ids = match (self.args.mode, d.layer) {
            (Mode::Logits, Some(l)) => layer_weights(self.cfg, l),
            _ => stage_weights(self.cfg, &d.stage),
        };
        let mut classified_by = "traces";
        if self.glmcheck_ran {
            if let Some(found) = self.weights_and_shards(&ids, d.layer)? {
                classified_by = "drill-down";
                report.fault = Some(merge(report.fault.take(), found));
            }
        }
        if let Some(path) = &self.args.actual {
            // A weight read inside the layer before the divergent stage may be the cause where
            // the stages between were not recorded (vLLM's sparse MLA never runs `kv_b_proj`
            // as a layer: its heads reach `attn.ctx` through the absorbed W_UK/W_UV).
            let mut found = manifest_fault(self.model, path, &ids)?;
            if found.is_none() && self.args.mode != Mode::Logits {
                let upstream = weights_up_to(self.cfg, &d.stage);
                found = manifest_fault(self.model, path, &upstream)?;
                if let Some(f) = &mut found {
                    f.evidence.push(format!(
                        "read in the layer before {}, whose own weights are as planned",
                        d.stage
                    ));
                }
            }
            if let Some(found) = found {
                classified_by = "shard manifest";
                report.fault = Some(merge(report.fault.take(), found));
            }
        }
        Ok(classified_by)
    }

    fn weights_and_shards(
        &self,
        ids: &[WeightId],
        layer: Option<u64>,
    ) -> anyhow::Result<Option<Fault>> {
        let (files, cfg, family) = open_model(self.model)?;
        let ref_src = WeightSource::new(files, cfg, family);
        let (files, cfg, family) = open_model(self.cand_model)?;
        let cand_src = WeightSource::new(files, cfg, family).with_fault(self.args.inject);
        let cand = CandidateRun {
            src: &cand_src,
            tp: self.args.tp as usize,
            same_files: self.cand_model == self.model,
            experts: chosen_experts(self.candidate, layer)?,
        };
        if cand.same_files {
            return drill_down(&ref_src, &cand, ids);
        }
        // A conversion's stored values are the weight check's (`--weights`); here are its
        // shards, and the candidate's reading of its own bytes against a correct one (a planted
        // dequantizer fault).
        if cand.tp > 1 {
            if let Some(f) = check_shards(&ref_src, &cand, ids)? {
                return Ok(Some(f));
            }
        }
        let (files, cfg, family) = open_model(self.cand_model)?;
        let own_bytes = WeightSource::new(files, cfg, family);
        let read_wrong = CandidateRun {
            same_files: true,
            ..cand
        };
        drill_down(&own_bytes, &read_wrong, ids)
    }
}

/// An engine trace that records the GGUF it ran (the llama.cpp probe): the metadata llama.cpp
/// read against the reference's config, then, where no key explains the first divergence, that
/// file's tensors behind the divergent stage against the reference (`--weights`).
fn engine_cause(
    args: &BisectArgs,
    model: &Path,
    cfg: &Glm5Config,
    candidate: &Trace,
    report: &mut DiffReport,
    weight_check: &mut Option<WeightsInfo>,
) -> anyhow::Result<Option<&'static str>> {
    let info = &candidate.manifest().model;
    let Some(meta) = gguf_meta::metadata(&info.config) else {
        return Ok(None);
    };
    if gguf_meta::explain(meta, cfg, report) {
        return Ok(Some("gguf metadata"));
    }
    let gguf = PathBuf::from(&info.source);
    let Some(d) = report.first_divergence.clone() else {
        return Ok(None);
    };
    if args.weights == WeightCheck::Off || !gguf.is_file() {
        return Ok(None);
    }
    let checked = weights::check_tensors_of(model, &gguf, &stage_weights(cfg, &d.stage))
        .with_context(|| format!("{}: the weight check", gguf.display()))?;
    let decided = weights::apply(report, &checked, model, &gguf, merge)?;
    *weight_check = Some(checked);
    Ok(decided.then_some("weights"))
}

/// The report as a candidate showing only its logits gives it: the logits stage alone.
fn logits_view(mut report: DiffReport) -> anyhow::Result<DiffReport> {
    let logits = logits_of(&report)
        .cloned()
        .context("the traces hold no logits")?;
    report.verdict = logits.status;
    report.tolerance_to_pass = logits.rel_diff;
    report.first_divergence = None;
    if logits.status == Status::Pass {
        report.fault = None;
    }
    report.stages = vec![logits];
    Ok(report)
}

/// What an engine's shard manifest says of the shards of `ids`: the first weight some rank
/// holds another slice of than the plan gives.
fn manifest_fault(
    model: &Path,
    manifest: &Path,
    ids: &[WeightId],
) -> anyhow::Result<Option<Fault>> {
    let m = ShardManifest::read(manifest)?;
    let (files, cfg, family) = open_model(model)?;
    let ws = WeightSource::new(files, cfg, family);
    let checked = check_only(&ws, &m, ids).with_context(|| manifest.display().to_string())?;
    let wrong: Vec<_> = checked.iter().filter(|c| c.class.is_some()).collect();
    let Some(first) = wrong.first() else {
        return Ok(None);
    };
    let same: Vec<_> = wrong.iter().filter(|c| c.weight == first.weight).collect();
    let class = first.class.unwrap_or(FaultClass::Unknown);
    let what = match class {
        FaultClass::WrongDequant => "dequantize their bytes otherwise than ggml",
        _ => "hold another slice than the plan gives",
    };
    Ok(Some(Fault {
        class,
        summary: format!(
            "{}: {} of {} ranks {what} (the engine's shard manifest)",
            first.weight,
            same.len(),
            m.tp
        ),
        evidence: same.iter().map(|c| c.evidence.clone()).collect(),
        weight: Some(first.weight.clone()),
    }))
}

/// The drill-down's finding joined with what the traces showed. A symptom the traces prove
/// (flat logits, the first NaN, an overflow) keeps its class, with the weight as its cause;
/// otherwise the weight or shard check names the class.
fn merge(traced: Option<Fault>, found: Fault) -> Fault {
    match traced {
        Some(mut t)
            if matches!(
                t.class,
                FaultClass::FlatLogits | FaultClass::NanOrigin | FaultClass::DtypeOverflow
            ) =>
        {
            t.evidence.push(format!("cause: {}", found.summary));
            t.evidence.extend(found.evidence);
            t.weight = found.weight;
            t
        }
        Some(t) => {
            let mut found = found;
            found.evidence.push(format!(
                "the traces alone: {} — {}",
                t.class.name(),
                t.summary
            ));
            found
        }
        None => found,
    }
}

/// The reference's run of `model` into `out`: CPU, TP 1, f32, every stage in full.
fn reference_spec<'a>(
    args: &BisectArgs,
    tokens: &'a [u32],
    model: &'a Path,
    out: &'a Path,
) -> RunSpec<'a> {
    RunSpec {
        model,
        tokens,
        out,
        full: FullSelector::new(&["**".to_string()]).expect("a valid glob"),
        latent_norm_eps: args.latent_norm_eps,
        dtype: Precision::F32,
        tp: 1,
        ep: false,
        backend: BackendKind::Cpu,
        process: None,
        inject: None,
        generate: args.generate,
        warm_up: 0,
        ties: None,
        stored_as: None,
        hybrid: None,
    }
}

/// The routed experts the candidate chose in `layer` (none recorded: none).
fn chosen_experts(candidate: &Trace, layer: Option<u64>) -> anyhow::Result<Vec<u64>> {
    let Some(l) = layer else {
        return Ok(Vec::new());
    };
    let name = format!("L{l}.moe.topk_ids");
    if candidate.stage(&name, None).is_none() {
        return Ok(Vec::new());
    }
    let Some(ids) = candidate.tensor(&name, None)? else {
        return Ok(Vec::new());
    };
    let mut e: Vec<u64> = ids
        .iter()
        .filter(|v| **v >= 0.0)
        .map(|&v| v as u64)
        .collect();
    e.sort_unstable();
    e.dedup();
    Ok(e)
}

pub fn print_bisect(out: &BisectReport) {
    let b = &out.bisect;
    print_report(&out.diff);
    println!();
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
    println!("{setup}");
    if let Some(e) = &b.envelope {
        let stored = if b.conversion {
            format!(", every weight stored as {} stores it", b.candidate)
        } else {
            String::new()
        };
        println!(
            "noise envelope: the reference re-run at {}{stored} ({e})",
            b.dtype
        );
    }
    if let Some(w) = &b.weights {
        let which = if w.checked == "all" {
            "every tensor"
        } else {
            "the divergent stage's tensors"
        };
        println!(
            "weight check ({which}): {} tensors, {} exact (ggml's bytes), {} within their type's \
             noise, {} failed",
            w.tensors, w.exact, w.within_noise, w.failed
        );
    }
    if b.ties_taken > 0 {
        println!(
            "{} top-k positions were near ties in the reference; the candidate took the \
             reference's choice there",
            b.ties_taken
        );
    }
    if b.ties_followed > 0 {
        println!(
            "{} top-k positions were near ties in the reference that the engine broke otherwise; \
             the reference and the envelope took the engine's choice there",
            b.ties_followed
        );
    }
    match (&out.diff.first_divergence, &out.diff.fault) {
        (Some(d), Some(f)) => {
            let rank = d.rank.map(|r| format!(" rank {r}")).unwrap_or_default();
            let source = match b.classified_by {
                "drill-down" => "from the weights and shards behind that stage",
                "weights" => "from the check of the candidate's weights against the reference",
                "shard manifest" => "from the engine's shard manifest",
                "gguf metadata" => "from the GGUF metadata the engine read",
                _ => "from the traces",
            };
            println!(
                "\ndiagnosis: {} at {}{rank} ({source})",
                f.class.name(),
                d.stage
            );
            println!("  {}", f.summary);
            for e in &f.evidence {
                println!("  · {e}");
            }
        }
        _ => println!("\ndiagnosis: no fault — the candidate agrees with the reference"),
    }
    if let (Some(p), Some(r)) = (&b.prompt, &b.reference_text) {
        println!("\nreference: {p}{r}");
        if let Some(c) = &b.candidate_text {
            println!("candidate: {p}{c}");
        }
    }
}
