//! `glmcheck endpoint`: a running OpenAI-compatible server (vLLM) asked for the top-k
//! log-probabilities at every position of a prompt given as token ids, and its answer held
//! against glmcheck's reference forward of the same model on the same ids.
//!
//! The server is asked first, for every prompt, so that a server that cannot answer is known
//! before the reference spends its time. The reference runs on the CPU at f32, TP 1, with the
//! latent RMSNorms at the config's `rms_norm_eps` (as vLLM builds them), its trace kept in a
//! temporary folder that is removed when the check ends: no prompt and no logits are left
//! behind.
//!
//! `--explain` then asks which catalogued fault (`glmcheck bisect --list-faults`) best explains
//! what the server said: the reference is run again with each fault planted that can exist at
//! the server's TP and dtype, and with none ("clean", the baseline), on the same prompts, and
//! each run scored by [`fit`](crate::compare::top_k::fit) against the server's log-probabilities. The loader faults come
//! first (at TP ≥ 2 the ColumnParallel weights loaded whole, the story's bug), so a `--budget`
//! spends its runs on the likeliest. A server that agrees with the reference has nothing to
//! explain, and nothing is run.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};

use super::record::{prompt_tokens, record, RunSpec};
use super::Model;
use crate::any_backend::BackendKind;
use crate::compare::stage_diff::whole_values;
use crate::compare::top_k::{compare, problems, ServerHealth};
use crate::compare::Status;
use crate::dtype::Precision;
use crate::endpoint::client::Client;
use crate::endpoint::openai::TopK;
use crate::report::endpoint::{EndpointReport, PromptCheck};
use crate::trace::{FullSelector, Trace};

mod ask;
mod concurrency;
mod explain;
mod misread;

use ask::{api, ask, served_model};
use explain::{explain, nothing_to_explain};

/// `--explain`: where the server runs, as far as the faults care.
pub struct ExplainSpec {
    /// The server's tensor-parallel degree (`None`: not given, taken as 1).
    pub tp: Option<u64>,
    pub dtype: Precision,
    /// The most runs, the clean one included (`None`: all).
    pub budget: Option<usize>,
    /// No progress bar (`--json`).
    pub quiet: bool,
}

/// What to ask, of which server, against which model.
pub struct EndpointSpec<'a> {
    /// The server's base URL (`http://host:port`).
    pub url: &'a str,
    /// The checkpoint the server serves, here on disk.
    pub model: &'a Path,
    /// Prompt texts, tokenized with the model's tokenizer.
    pub prompts: &'a [String],
    /// Prompts as token ids.
    pub token_prompts: &'a [Vec<u32>],
    pub top_k: u32,
    pub max_tokens: u32,
    /// The longest the whole exchange with the server may take, retries included.
    pub timeout: Duration,
    /// The tolerance on a log-probability, in nats.
    pub tolerance: f64,
    /// `--explain`: which catalogued fault explains the server.
    pub explain: Option<ExplainSpec>,
    /// `--concurrency N`: each prompt asked again beside N requests of glmcheck's own.
    pub concurrency: Option<usize>,
}

/// The server's answer for one prompt, before the reference runs.
struct Served {
    /// The log-probabilities asked for per position: `--top-k`, or the server's cap.
    top_k: u32,
    tokens: Vec<u32>,
    /// Per reference position, the server's top-k.
    positions: Vec<TopK>,
    generated: Vec<u32>,
    seconds: f64,
}

/// Ask the server, run the reference, compare.
pub fn check(spec: &EndpointSpec) -> anyhow::Result<EndpointReport> {
    if spec.top_k == 0 {
        bail!("--top-k: at least 1");
    }
    let model = Model::open(spec.model)?;
    let mut prompts = Vec::new();
    for text in spec.prompts {
        prompts.push(prompt_tokens(&model.files, Some(text), &[])?.0);
    }
    prompts.extend(spec.token_prompts.iter().cloned());
    if prompts.is_empty() {
        bail!("give a prompt: --prompt TEXT or --tokens IDS");
    }
    if let Some(e) = &spec.explain {
        crate::shard::plan::check_degree(&model.cfg, e.tp.unwrap_or(1))?;
        if e.budget.is_some_and(|b| b < 2) {
            bail!("--budget: at least 2 runs (the clean model and one fault)");
        }
    }
    let client = Client::new(spec.url, spec.timeout)?;
    let served_model = served_model(&client)?;
    let api = api(&client)?;
    let served = prompts
        .into_iter()
        .map(|tokens| ask(&client, api, &served_model, tokens, spec))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let concurrency = match spec.concurrency {
        Some(beside) => {
            let load = concurrency::Load {
                client: &client,
                served_model: &served_model,
                beside,
                max_tokens: spec.max_tokens,
                tolerance: spec.tolerance,
            };
            let again = |tokens| ask(&client, api, &served_model, tokens, spec);
            Some(concurrency::check(&load, &served, &again)?)
        }
        None => None,
    };
    let mut checks = Vec::new();
    for (i, s) in served.iter().enumerate() {
        checks.push(judge(&model, s, i + 1, spec)?);
    }
    let problems: Vec<String> = checks
        .iter()
        .flat_map(|c| {
            c.problems
                .iter()
                .map(|p| format!("prompt {}: {p}", c.index))
        })
        .collect();
    let explanation = match &spec.explain {
        Some(e) => Some(if problems.is_empty() {
            nothing_to_explain(e)
        } else {
            explain(&model, &served, e)?
        }),
        None => None,
    };
    let mut problems = problems;
    problems.extend(concurrency.iter().flat_map(|c| c.problems.clone()));
    Ok(EndpointReport {
        api,
        concurrency,
        explanation,
        max_tokens: spec.max_tokens,
        model: spec.model.display().to_string(),
        verdict: if problems.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        },
        problems,
        prompts: checks,
        served_model,
        top_k: spec.top_k,
        top_k_served: served.iter().map(|s| s.top_k).min().unwrap_or(spec.top_k),
        url: spec.url.to_string(),
    })
}

/// The reference's forward on the served prompt, compared with the server's answer.
fn judge(
    model: &Model,
    served: &Served,
    index: usize,
    spec: &EndpointSpec,
) -> anyhow::Result<PromptCheck> {
    let dir = tempfile::tempdir().context("a temporary folder for the reference's trace")?;
    let out = dir.path().join("reference.trace");
    let began = Instant::now();
    let recorded = record(RunSpec {
        model,
        tokens: &served.tokens,
        out: &out,
        full: FullSelector::new(&["logits"])?,
        latent_norm_eps: model.cfg.rms_norm_eps,
        dtype: Precision::F32,
        tp: 1,
        ep: false,
        backend: BackendKind::Cpu,
        process: None,
        inject: None,
        generate: spec.max_tokens as usize,
        warm_up: 0,
        ties: None,
        stored_as: None,
        hybrid: None,
    })?;
    let reference_seconds = began.elapsed().as_secs_f64();
    let trace = Trace::open(&out)?;
    let Some((logits, shape)) = whole_values(&trace, "logits")? else {
        bail!("the reference's trace holds no logits");
    };
    let vocab = *shape.last().unwrap_or(&1) as usize;
    let rows = served.positions.len();
    let logits = &logits[..rows * vocab];
    let comparison = compare(logits, vocab, &served.positions, spec.tolerance)
        .map_err(|e| anyhow!("{}: {e}", spec.url))?;
    let health = ServerHealth::of(
        &served.positions,
        &comparison,
        logits,
        vocab,
        &served.generated,
        &recorded.generated,
    );
    let problems = problems(&comparison, &health);
    Ok(PromptCheck {
        continuation_differs_at: served
            .generated
            .iter()
            .zip(&recorded.generated)
            .position(|(a, b)| a != b),
        comparison,
        continuation: served.generated.clone(),
        health,
        index,
        verdict: if problems.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        },
        problems,
        reference_continuation: recorded.generated,
        reference_seconds,
        server_seconds: served.seconds,
        tokens: served.tokens.len(),
    })
}
