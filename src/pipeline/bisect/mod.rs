//! `glmcheck bisect MODEL`: the one-shot diagnosis. Runs the reference (MODEL on the CPU, TP 1,
//! f32) and the candidate (MODEL at the given TP, dtype and planted fault, or an engine's trace),
//! compares them stage by stage — against the reference re-run at the candidate's dtype as the
//! noise envelope, with near ties at top-k boundaries resolved as the reference resolved them —
//! then drills down at the first divergence (the weights that stage reads and each rank's
//! shard of them) and names the faulty step with its evidence.

use std::path::Path;

use anyhow::{bail, Context};

mod engine;
mod hybrid;
mod options;
mod weights;

use super::record::{prompt_tokens, record, RunSpec};
use super::Model;
use crate::compare::{diff, DiffOptions, DiffReport, Fault, FaultClass, Status};
use crate::diagnose::manifest::{check_only, CheckedShard};
use crate::diagnose::{check_shards, drill_down, indexer, router, CandidateRun};
use crate::dtype::Precision;
use crate::exec::ops::ties::TieBreaks;
use crate::model::names::WeightId;
use crate::model::stage::Stage;
use crate::model::stages::{layer_weights, stage_weights, weights_up_to};
use crate::model::tokenize;
use crate::model::Glm5Config;
use crate::progress::progress;
pub use crate::report::bisect::{
    BisectInfo, BisectReport, HybridRun, PathInfo, Replay, WeightsInfo,
};
use crate::shard::manifest::ShardManifest;
use crate::trace::{FullSelector, Trace};
use engine::engine_cause;
use hybrid::{logits_of, Hybrids};
pub use options::{BisectOptions, Candidate, Mode, RunAs};
pub use weights::WeightCheck;

/// The prompt when none is given.
pub const DEFAULT_PROMPT: &str = "The capital of France is";

pub use crate::trace::is_trace;

/// Run both sides, compare, drill down.
pub fn bisect(args: &BisectOptions) -> anyhow::Result<BisectReport> {
    let model = args.model.clone();
    let engine_trace = match &args.candidate {
        Candidate::EngineTrace(p) => Some(p.as_path()),
        _ => None,
    };
    let run_as = args.candidate.run_as().unwrap_or_default();
    if engine_trace.is_some() && args.mode == Mode::Logits {
        bail!("--mode logits bisects with hybrid runs: the candidate is a MODEL, not a TRACE");
    }
    let reference_model = Model::open(&model)?;
    let cfg = &reference_model.cfg;
    let prompt_text = match (&args.prompt, args.tokens.is_empty(), engine_trace) {
        (_, _, Some(_)) => None,
        (Some(p), _, _) => Some(p.clone()),
        (None, true, _) => Some(DEFAULT_PROMPT.to_string()),
        (None, false, _) => None,
    };
    let (mut tokens, tokenizer) =
        prompt_tokens(&reference_model.files, prompt_text.as_deref(), &args.tokens).or_else(
            |e| match &prompt_text {
                Some(_) => Err(e),
                None => Ok((vec![0], None)),
            },
        )?;
    // An SGLang dump is read as a run of the reference's weights.
    let engine = engine_trace
        .map(|p| crate::trace::sglang::open_candidate(p, cfg, reference_model.run_info()))
        .transpose()?;
    if let Some(t) = &engine {
        tokens = t.manifest().tokens.clone();
    }
    let scratch = tempfile::tempdir()?;
    let dir = args.out.as_deref().unwrap_or(scratch.path());
    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
    let cand_model = match &args.candidate {
        Candidate::Checkpoint(path, _) => path.clone(),
        _ => model.clone(),
    };
    // A conversion (another model's files) is judged against the reference with every weight
    // stored as the candidate stores it: its quantization noise is not a fault.
    let conversion = engine.is_none() && cand_model != model;
    // An engine's trace of a quantized GGUF is judged the same way, against that file's types.
    let engine_gguf = match &engine {
        Some(t) => engine::quantized_engine_file(t, &reference_model)?,
        None => None,
    };
    // Each model is opened once, here, and shared by every run and check below.
    let cand = match (engine.is_some(), conversion) {
        (false, true) => Some(Model::open(&cand_model)?),
        (false, false) => Some(reference_model.clone()),
        (true, _) => None,
    };
    let stored_as = match conversion {
        true => cand.as_ref(),
        false => engine_gguf.as_ref(),
    };
    // An engine's trace says its dtype; the envelope is the reference run at it.
    let dtype = match &engine {
        Some(t) => Precision::from_name(&t.manifest().dtype)
            .with_context(|| format!("{}: dtype", t.dir().display()))?,
        None => run_as.dtype,
    };
    let lower = stored_as.is_some() || !matches!(dtype, Precision::F32 | Precision::F64);
    let check_all = conversion
        && cand
            .as_ref()
            .is_some_and(|c| weights::check_all(args.weights, c));
    let steps = 3 + u64::from(lower) + u64::from(check_all);
    let bar = progress(steps, args.quiet, "bisect");
    let mut weight_check = None;
    if check_all {
        bar.set_message("weight check: every candidate tensor against the reference");
        weight_check = Some(weights::check_every_tensor(
            &reference_model,
            cand_of(&cand)?,
        )?);
        bar.inc(1);
    }
    let paths = ["reference", "envelope", "candidate"].map(|n| dir.join(format!("{n}.trace")));
    let on = args.reference_backend.name();
    bar.set_message(format!("reference run ({on}, TP 1, f32)"));
    let ref_run = record(reference_spec(args, &tokens, &reference_model, &paths[0]))?;
    bar.inc(1);
    let reference = Trace::open(&paths[0])?;
    let ties = if lower {
        TieBreaks::from_trace(&reference)?
    } else {
        TieBreaks::default()
    };
    let envelope = if lower {
        bar.set_message(format!("envelope run ({on}, TP 1, {})", dtype.name()));
        record(RunSpec {
            dtype,
            ties: Some(&ties),
            stored_as,
            ..reference_spec(args, &tokens, &reference_model, &paths[1])
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
                ..reference_spec(args, &tokens, &reference_model, &r)
            })?;
            record(RunSpec {
                dtype,
                ties: Some(&followed),
                stored_as,
                ..reference_spec(args, &tokens, &reference_model, &e)
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
                run_as.tp,
                run_as.dtype.name(),
                run_as
                    .inject
                    .map(|f| format!(", {}", f.spec()))
                    .unwrap_or_default()
            ));
            let ties = lower.then_some(&ties);
            let run = record(RunSpec {
                dtype: run_as.dtype,
                tp: run_as.tp,
                ep: run_as.ep,
                backend: run_as.backend,
                inject: run_as.inject,
                ties,
                ..reference_spec(args, &tokens, cand_of(&cand)?, &paths[2])
            })?;
            (Trace::open(&paths[2])?, Some(run))
        }
    };
    bar.inc(1);
    bar.set_message("compare and drill down");
    // An engine's stages computed at some positions only are judged at those (the drill-down too).
    if let Some(cut) = reference.at_rows_of(&candidate)? {
        reference = cut;
    }
    if let Some(cut) = envelope
        .as_ref()
        .map(|e| e.at_rows_of(&candidate))
        .transpose()?
        .flatten()
    {
        envelope = Some(cut);
    }
    let opts = DiffOptions {
        tolerance: None,
        envelope: envelope.as_ref(),
    };
    let mut report = diff(&reference, &candidate, &opts)?;
    // Hybrid runs and the replay need a candidate glmcheck runs (an engine's trace has none).
    let runs = cand.as_ref().map(|cand_model| Hybrids {
        args,
        run_as,
        tokens: &tokens,
        model: &reference_model,
        cand_model,
        dir,
        reference: &reference,
        envelope: envelope.as_ref(),
        ties: lower.then_some(&ties),
    });
    let mut hybrids = Vec::new();
    let mut replay = None;
    match (args.mode, &runs) {
        (Mode::Logits, Some(runs)) => {
            report = logits_view(report)?;
            if report.verdict == Status::Fail {
                bar.set_message("hybrid runs: the candidate up to a layer, the reference after it");
                hybrids = runs.locate_fault(cfg, &mut report, &candidate, lower)?;
            }
        }
        (Mode::Stages, Some(runs)) if cand_run.is_some() => {
            if let Some(d) = &report.first_divergence {
                bar.set_message("replay from the reference's input");
                replay = runs.replay(cfg, &d.stage)?;
            }
        }
        _ => {}
    }
    let cause = Cause {
        args,
        run_as,
        model: &reference_model,
        cand_model: cand.as_ref().filter(|_| cand_run.is_some()),
        candidate: &candidate,
    };
    let mut classified_by = cause.explain(&mut report)?;
    let mut path = None;
    if cand_run.is_none() && args.mode == Mode::Stages {
        if let Some(by) = engine_cause(
            args,
            &reference_model,
            engine_gguf.as_ref(),
            &candidate,
            &mut report,
            &mut weight_check,
            &mut path,
        )? {
            classified_by = by;
        }
    }
    if let (true, Some(cand_model)) = (conversion && args.weights != WeightCheck::Off, &cand) {
        if let (None, Some(d)) = (&weight_check, &report.first_divergence) {
            bar.set_message("weight check: the divergent stage's tensors");
            let ids = match (args.mode, d.layer) {
                (Mode::Logits, Some(l)) => layer_weights(cfg, l),
                _ => stage_weights(cfg, &d.stage),
            };
            weight_check = Some(weights::check_tensors_of(
                &reference_model,
                cand_model,
                &ids,
            )?);
        }
        if let Some(info) = &weight_check {
            if weights::apply(&mut report, info, &reference_model, cand_model, merge)? {
                classified_by = "weights";
            }
        }
    }
    if let (Some(f), Some(r)) = (&mut report.fault, &replay) {
        f.evidence.push(r.evidence());
    }
    let source = reference_model.source();
    let how = (classified_by == "traces", lower.then_some(&ties));
    router::explain_choice(&source, (&reference, &candidate), &mut report, how)?;
    indexer::explain_choice(&source, (&reference, &candidate), &mut report, how)?;
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
            candidate: match &args.candidate {
                Candidate::Checkpoint(p, _) | Candidate::EngineTrace(p) => p.display().to_string(),
                Candidate::Run(_) => model.display().to_string(),
            },
            backend: if cand_run.is_some() {
                run_as.backend.name().to_string()
            } else {
                candidate.manifest().backend.clone()
            },
            reference_backend: args.reference_backend.name(),
            tp: if cand_run.is_some() {
                run_as.tp
            } else {
                u64::from(candidate.manifest().tp)
            },
            dtype: dtype.name().into(),
            inject: run_as.inject.map(|f| f.spec()),
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
            path,
            not_recorded: match cand_run {
                Some(_) => Vec::new(),
                None => not_recorded(cfg, &candidate),
            },
            candidate_notes: candidate
                .manifest()
                .producer
                .get("notes")
                .and_then(|n| serde_json::from_value(n.clone()).ok())
                .unwrap_or_default(),
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

/// The forward's stages `trace` holds neither whole nor as rank parts.
fn not_recorded(cfg: &Glm5Config, trace: &Trace) -> Vec<String> {
    crate::model::stages::stage_names(cfg)
        .into_iter()
        .filter(|n| !trace.stages().iter().any(|s| s.name == *n))
        .collect()
}

/// The candidate's model, where glmcheck runs the candidate.
fn cand_of(cand: &Option<Model>) -> anyhow::Result<&Model> {
    cand.as_ref()
        .context("an engine's trace has no model for glmcheck to run")
}

/// Rounds of re-running the reference with an engine's near-tie choices: each may reach a near
/// tie further on that the engine also broke its own way.
const FOLLOW_ROUNDS: usize = 3;

/// What explains a first divergence beyond the traces: the weights and shards behind it (when
/// glmcheck ran the candidate), and an engine's shard manifest (`--actual`).
struct Cause<'a> {
    args: &'a BisectOptions,
    run_as: RunAs,
    model: &'a Model,
    /// The candidate's model when glmcheck ran it.
    cand_model: Option<&'a Model>,
    candidate: &'a Trace,
}

impl Cause<'_> {
    /// Give `report` the cause found, if any; where its class came from.
    fn explain(&self, report: &mut DiffReport) -> anyhow::Result<&'static str> {
        let Some(d) = report.first_divergence.clone() else {
            return Ok("traces");
        };
        // In logits mode the divergence is a whole layer.
        let cfg = &self.model.cfg;
        let ids = match (self.args.mode, d.layer) {
            (Mode::Logits, Some(l)) => layer_weights(cfg, l),
            _ => stage_weights(cfg, &d.stage),
        };
        let mut classified_by = "traces";
        if let Some(cand_model) = self.cand_model {
            if let Some(found) = self.weights_and_shards(cand_model, &ids, d.layer)? {
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
                let upstream = weights_up_to(cfg, &d.stage);
                found = manifest_fault(self.model, path, &upstream)?;
                if let Some(f) = &mut found {
                    f.evidence.push(format!(
                        "read earlier in the layer than {}, whose own weights are as planned",
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
        cand_model: &Model,
        ids: &[WeightId],
        layer: Option<u64>,
    ) -> anyhow::Result<Option<Fault>> {
        let ref_src = self.model.source();
        let cand_src = cand_model.source().with_fault(self.run_as.inject);
        let cand = CandidateRun {
            src: &cand_src,
            tp: self.run_as.tp as usize,
            same_files: cand_model.path() == self.model.path(),
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
        let own_bytes = cand_model.source();
        let read_wrong = CandidateRun {
            same_files: true,
            ..cand
        };
        drill_down(&own_bytes, &read_wrong, ids)
    }
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
/// holds another slice of than the plan gives, a recognised slice (another rank's, the whole)
/// before one that matches nothing. An FP8 weight's block scales (`…_scale_inv`) count as
/// their own entries: scales cut wrong make the weight they scale match nothing, and the
/// scales' entry says why; the weight's own evidence follows.
fn manifest_fault(
    model: &Model,
    manifest: &Path,
    ids: &[WeightId],
) -> anyhow::Result<Option<Fault>> {
    let m = ShardManifest::read(manifest)?;
    let checked =
        check_only(&model.source(), &m, ids).with_context(|| manifest.display().to_string())?;
    let wrong: Vec<_> = checked.iter().filter(|c| c.class.is_some()).collect();
    let recognised = wrong
        .iter()
        .find(|c| c.class.is_some_and(|k| k != FaultClass::Unknown));
    let Some(first) = recognised.or(wrong.first()) else {
        return Ok(None);
    };
    let stem = |name: &str| name.strip_suffix("_scale_inv").unwrap_or(name).to_string();
    let same: Vec<_> = wrong.iter().filter(|c| c.weight == first.weight).collect();
    let scaled: Vec<String> = wrong
        .iter()
        .filter(|c| c.weight != first.weight && stem(&c.weight) == stem(&first.weight))
        .map(|c| c.evidence.clone())
        .collect();
    let class = first.class.unwrap_or(FaultClass::Unknown);
    let others: Vec<_> = wrong
        .iter()
        .copied()
        .filter(|c| stem(&c.weight) != stem(&first.weight))
        .collect();
    let also = others_alike(&others, first);
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
        evidence: same
            .iter()
            .map(|c| c.evidence.clone())
            .chain(scaled)
            .chain(also)
            .collect(),
        weight: Some(first.weight.clone()),
    }))
}

/// One line naming the other weights the check finds wrong in the same way as `first`, with
/// their ranks: a loader bug seldom spares a weight's siblings (a merged layer's other part, the
/// shared experts), and the list tells the user how far it reaches.
fn others_alike(wrong: &[&CheckedShard], first: &CheckedShard) -> Option<String> {
    let mut by_weight: Vec<(&str, Vec<u64>)> = Vec::new();
    for c in wrong.iter().filter(|c| c.class == first.class) {
        match by_weight.iter_mut().find(|(w, _)| *w == c.weight) {
            Some((_, ranks)) => ranks.push(c.rank),
            None => by_weight.push((&c.weight, vec![c.rank])),
        }
    }
    if by_weight.is_empty() {
        return None;
    }
    let listed: Vec<String> = by_weight
        .iter()
        .map(|(w, ranks)| {
            let ranks: Vec<String> = ranks.iter().map(u64::to_string).collect();
            format!("{w} (rank {})", ranks.join(", "))
        })
        .collect();
    Some(format!("the same on {}", listed.join("; ")))
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
    args: &BisectOptions,
    tokens: &'a [u32],
    model: &'a Model,
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
        backend: args.reference_backend,
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
    let name = Stage::layer_stage(l, "moe.topk_ids").to_string();
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
