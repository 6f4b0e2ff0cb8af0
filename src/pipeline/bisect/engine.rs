//! An engine's trace (`--candidate TRACE`): what stands behind its first divergence. Engines
//! skip stages — llama.cpp's graph and vLLM's absorbed MLA never form `attn.kv`, a fused MoE
//! never shows its routing — so a fault in a weight or a key that only such a hidden stage reads
//! first shows one or more stages later. The way back from the divergent stage to the stages the
//! trace holds (and that agree) is the path: every weight and metadata key on it is checked,
//! and the report names the hidden stages and what was checked for them.

use std::path::PathBuf;

use anyhow::Context;

use super::weights::{self, WeightCheck};
use super::{merge, BisectOptions};
use super::{PathInfo, WeightsInfo};
use crate::compare::stage_diff::Basis;
use crate::compare::{DiffReport, Status};
use crate::diagnose::settings;
use crate::model::schema::Family;
use crate::model::stages::{hidden_behind, weights_of};
use crate::pipeline::Model;
use crate::trace::Trace;
use crate::weights::{Encoding, GgmlType};

/// The path's stages: the divergent one and those behind it that no recorded value proves.
fn path_stages(p: &PathInfo) -> Vec<String> {
    let mut all = p.hidden.clone();
    all.extend(p.statistics_only.iter().cloned());
    all.push(p.divergent.clone());
    all
}

/// The weight file an engine trace ran, where it is at hand, is not the reference's own, and
/// can be judged against it: a GGUF against any reference, a checkpoint against a checkpoint
/// (against a GGUF reference a checkpoint's full-precision values would depart by the
/// reference's own quantization noise).
fn engine_file(trace: &Trace, reference: &Model) -> Option<PathBuf> {
    let source = PathBuf::from(&trace.manifest().model.source);
    let gguf = source.is_file() && source.extension().is_some_and(|e| e == "gguf");
    let checkpoint = source.join("config.json").is_file() && reference.family == Family::Hf;
    let same = match (source.canonicalize(), reference.path().canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    ((gguf || checkpoint) && !same).then_some(source)
}

/// The engine's GGUF, opened, where it stores weights quantized (a type other than F32, F16 or
/// BF16): the engine's trace is judged against the reference with every weight stored as that
/// file stores it, whoever ran it (llama.cpp, vLLM's GGUF loader, glmcheck itself).
pub fn quantized_engine_file(trace: &Trace, reference: &Model) -> anyhow::Result<Option<Model>> {
    let Some(path) = engine_file(trace, reference).filter(|p| p.is_file()) else {
        return Ok(None);
    };
    let file = Model::open(&path)?;
    let quantized = file.files.tensors().iter().any(|t| {
        matches!(t.encoding, Encoding::Ggml(ty)
            if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16))
    });
    Ok(quantized.then_some(file))
}

/// What an engine trace's own evidence says: the GGUF metadata llama.cpp read (or the
/// config.json vLLM or transformers took) against the reference's config for every stage on
/// the path, then the engine's weight file against the
/// reference (every tensor under `--weights all`, or `auto` up to 32 GiB; else the path's).
/// Returns where the class came from, if these decided it.
pub fn engine_cause(
    args: &BisectOptions,
    model: &Model,
    opened: Option<&Model>,
    candidate: &Trace,
    report: &mut DiffReport,
    weight_check: &mut Option<WeightsInfo>,
    path: &mut Option<PathInfo>,
) -> anyhow::Result<Option<&'static str>> {
    let info = &candidate.manifest().model;
    let settings =
        settings::Settings::of(info).with_context(|| format!("{}", candidate.dir().display()))?;
    let file = engine_file(candidate, model);
    *path = report.first_divergence.as_ref().map(|d| {
        let before = report
            .stages
            .iter()
            .take_while(|r| r.status == Status::Pass);
        // A stage closes the way back where its agreement was seen in its values (or ids), or
        // its content hash equals the reference's.
        let proven: Vec<&str> = before
            .filter(|r| r.rank.is_none())
            .filter(|r| r.basis != Basis::Stats || r.rel_diff == 0.0)
            .map(|r| r.stage.as_str())
            .collect();
        let behind = hidden_behind(&model.cfg, &d.stage, |s| proven.contains(&s));
        let (statistics_only, hidden) = behind
            .into_iter()
            .partition(|s| candidate.stages().iter().any(|r| r.name == *s));
        let mut p = PathInfo {
            divergent: d.stage.clone(),
            hidden,
            statistics_only,
            file: file.as_ref().map(|f| f.display().to_string()),
            tensors: Vec::new(),
            keys: Vec::new(),
        };
        p.keys = settings::keys_on(settings.as_ref(), &path_stages(&p));
        p
    });
    let stages = path.as_ref().map(path_stages).unwrap_or_default();
    let ids = weights_of(&model.cfg, &stages);
    if let Some(settings) = &settings {
        if settings::explain(settings, &model.cfg, report, &stages) {
            return Ok(Some(match settings {
                settings::Settings::Gguf(_) => "gguf metadata",
                settings::Settings::Config(_) => "engine config",
            }));
        }
    }
    let Some(file) = file.filter(|_| args.weights != WeightCheck::Off) else {
        return Ok(None);
    };
    // The engine's file, unless already opened as the envelope's storage.
    let engine = match opened.filter(|m| m.path() == file) {
        Some(m) => m.clone(),
        None => Model::open(&file)?,
    };
    let checked = if weights::check_all(args.weights, &engine) {
        weights::check_every_tensor(model, &engine)
    } else if report.first_divergence.is_some() {
        weights::check_tensors_of(model, &engine, &ids)
    } else {
        return Ok(None);
    }
    .with_context(|| format!("{}: the weight check", file.display()))?;
    if let Some(p) = path.as_mut() {
        let src = engine.source();
        p.tensors = ids.iter().flat_map(|&id| src.tensor_names(id)).collect();
    }
    let decided = weights::apply(report, &checked, model, &engine, merge)?;
    if let (Some(p), Some(f), true) = (path.as_ref(), report.fault.as_mut(), decided) {
        if !p.hidden.is_empty() {
            f.evidence.push(format!(
                "the engine's trace holds no {}: the weights behind {} were checked in its file",
                p.hidden.join(", "),
                p.divergent
            ));
        }
        if !p.statistics_only.is_empty() {
            f.evidence.push(format!(
                "the engine's trace keeps {} as statistics only: their agreement did not close \
                 the way back from {}",
                p.statistics_only.join(", "),
                p.divergent
            ));
        }
    }
    *weight_check = Some(checked);
    Ok(decided.then_some("weights"))
}
