//! The gate's candidate: a trace as it is, or a model run here as its baseline was (dtype, TP,
//! prompt, eps, the near-tie choices), then held to the baseline.

use std::path::{Path, PathBuf};

use anyhow::bail;

use super::bisect::DEFAULT_PROMPT;
use super::record::{prompt_tokens, record, RunSpec};
use super::Model;
use crate::any_backend::BackendKind;
use crate::dtype::Precision;
use crate::exec::faults::inject::Injection;
use crate::exec::forward::HF_LATENT_NORM_EPS;
use crate::gate::{self, check::GateReport, Baseline};
use crate::trace::{FullSelector, Trace, DEFAULT_FULL};

/// How a model candidate runs; each `None` takes the baseline's value (else the default).
#[derive(Clone, Debug, Default)]
pub struct ModelRun {
    pub dtype: Option<Precision>,
    pub tp: Option<u64>,
    pub ep: bool,
    pub backend: BackendKind,
    pub inject: Option<Injection>,
    pub tokens: Vec<u32>,
    pub prompt: Option<String>,
    pub latent_norm_eps: Option<f64>,
    /// Keep the candidate's trace here instead of a temporary folder.
    pub out: Option<PathBuf>,
}

impl ModelRun {
    /// The first option given that only a model candidate takes (as its flag), if any.
    fn model_only(&self) -> Option<&'static str> {
        [
            ("--dtype", self.dtype.is_some()),
            ("--tp", self.tp.is_some()),
            ("--ep", self.ep),
            ("--inject", self.inject.is_some()),
            ("--tokens", !self.tokens.is_empty()),
            ("--prompt", self.prompt.is_some()),
            ("--latent-norm-eps", self.latent_norm_eps.is_some()),
            ("--out", self.out.is_some()),
        ]
        .into_iter()
        .find_map(|(flag, given)| given.then_some(flag))
    }
}

pub use crate::trace::is_trace;

/// The candidate's trace folder: `candidate` itself when it is a trace, else the model run as
/// `run` and the baseline say, into `run.out` or `scratch`.
pub fn candidate_trace(
    candidate: &Path,
    run: &ModelRun,
    baseline: Option<&Baseline>,
    scratch: &Path,
) -> anyhow::Result<PathBuf> {
    if is_trace(candidate) {
        if let Some(flag) = run.model_only() {
            bail!(
                "{}: {flag} applies to a model candidate, and this is a trace",
                candidate.display()
            );
        }
        return Ok(candidate.to_path_buf());
    }
    if !candidate.exists() {
        bail!("{}: no such trace or model", candidate.display());
    }
    let out = run
        .out
        .clone()
        .unwrap_or_else(|| scratch.join("candidate.trace"));
    record_model(candidate, run, baseline, &out)?;
    Ok(out)
}

/// `trace` of `candidate` held to `baseline` (read from `baseline_path`).
pub fn check(
    baseline: &Baseline,
    baseline_path: &Path,
    candidate: &Path,
    trace: &Trace,
) -> anyhow::Result<GateReport> {
    let mut report = gate::check(baseline, trace, &baseline_path.display().to_string())?;
    let ran_here = !is_trace(candidate);
    report.candidate = match ran_here {
        false => candidate.display().to_string(),
        true => format!("{} (run here)", candidate.display()),
    };
    let taken = baseline.tie_breaks().count();
    if taken > 0 && ran_here {
        report.notes.push(format!(
            "{taken} top-k positions were near ties in the baseline's run; the candidate run took the baseline's choice there"
        ));
    }
    Ok(report)
}

/// Run the model `candidate` as the baseline (or `run`) says, into `out`.
fn record_model(
    candidate: &Path,
    run: &ModelRun,
    baseline: Option<&Baseline>,
    out: &Path,
) -> anyhow::Result<()> {
    let model = Model::open(candidate)?;
    let prompt = match (&run.prompt, run.tokens.is_empty(), baseline) {
        (Some(p), _, _) => Some(p.clone()),
        (None, false, _) | (None, true, Some(_)) => None,
        (None, true, None) => Some(DEFAULT_PROMPT.to_string()),
    };
    let ids = match (run.tokens.is_empty(), baseline) {
        (true, Some(b)) => b.tokens.clone(),
        _ => run.tokens.clone(),
    };
    let (tokens, _) = prompt_tokens(&model.files, prompt.as_deref(), &ids)?;
    let dtype = match (run.dtype, baseline) {
        (Some(d), _) => d,
        (None, Some(b)) => Precision::from_name(&b.dtype)?,
        (None, None) => Precision::F32,
    };
    let tp = run.tp.or(baseline.map(|b| u64::from(b.tp))).unwrap_or(1);
    let ep = run.ep || baseline.is_some_and(|b| b.ep);
    let latent_norm_eps = run
        .latent_norm_eps
        .or(baseline.and_then(Baseline::latent_norm_eps))
        .unwrap_or(HF_LATENT_NORM_EPS);
    // The logits and layer outputs in full, and the top-k boundary gaps so that a baseline knows
    // its near ties, with the choices made there; the baseline's choices at its near ties are
    // taken again.
    let mut full: Vec<&str> = DEFAULT_FULL.to_vec();
    full.extend([
        "L*.attn.index_gap",
        "L*.moe.topk_gap",
        "L*.attn.index_topk",
        "L*.moe.topk_ids",
    ]);
    let ties = baseline.map(Baseline::tie_breaks);
    record(RunSpec {
        model: &model,
        tokens: &tokens,
        out,
        full: FullSelector::new(&full)?,
        latent_norm_eps,
        dtype,
        tp,
        ep,
        backend: run.backend,
        process: None,
        inject: run.inject,
        generate: 0,
        warm_up: 0,
        ties: ties.as_ref().filter(|t| t.count() > 0),
        stored_as: None,
        hybrid: None,
    })?;
    Ok(())
}
