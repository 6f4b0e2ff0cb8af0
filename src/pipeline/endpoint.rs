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
//! each run scored by [`fit`] against the server's log-probabilities. The loader faults come
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
use crate::compare::top_k::{compare, fit, problems, ServerHealth};
use crate::compare::Status;
use crate::dtype::Precision;
use crate::endpoint::client::Client;
use crate::endpoint::openai::{completion_request, parse_answer, Answer, TopK};
use crate::exec::faults::inject::{Injection, CATALOGUE};
use crate::model::stages::{stage_names, stage_weights};
use crate::report::endpoint::{
    EndpointReport, ExplainVerdict, Explanation, Hypothesis, PromptCheck, EXPLAIN_RULE,
};
use crate::trace::{FullSelector, Trace};
use crate::weights::GgmlType;

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
    /// A prompt as token ids (empty: none).
    pub tokens: &'a [u32],
    pub top_k: u32,
    pub max_tokens: u32,
    /// The longest the whole exchange with the server may take, retries included.
    pub timeout: Duration,
    /// The tolerance on a log-probability, in nats.
    pub tolerance: f64,
    /// `--explain`: which catalogued fault explains the server.
    pub explain: Option<ExplainSpec>,
}

/// The server's answer for one prompt, before the reference runs.
struct Served {
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
    if !spec.tokens.is_empty() {
        prompts.push(spec.tokens.to_vec());
    }
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
    let served = prompts
        .into_iter()
        .map(|tokens| ask(&client, &served_model, tokens, spec))
        .collect::<anyhow::Result<Vec<_>>>()?;
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
    Ok(EndpointReport {
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
        url: spec.url.to_string(),
    })
}

/// The first model the server lists (`/v1/models`), the name requests must give.
fn served_model(client: &Client) -> anyhow::Result<String> {
    let url = client.url("/v1/models");
    let text = client.get("/v1/models")?;
    let list: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow!("{url}: not JSON: {e}"))?;
    list.pointer("/data/0/id")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .ok_or_else(|| anyhow!("{url}: data[0].id: no model listed"))
}

/// One prompt asked of the server, its answer checked for what the comparison needs.
fn ask(
    client: &Client,
    served_model: &str,
    tokens: Vec<u32>,
    spec: &EndpointSpec,
) -> anyhow::Result<Served> {
    let url = client.url("/v1/completions");
    let began = Instant::now();
    let request = completion_request(served_model, &tokens, spec.top_k, spec.max_tokens);
    let text = client.post_json("/v1/completions", &request)?;
    let seconds = began.elapsed().as_secs_f64();
    let answer = parse_answer(&text).map_err(|e| anyhow!("{url}: {e}"))?;
    let positions = positions(&answer, &tokens).map_err(|e| anyhow!("{url}: {e}"))?;
    Ok(Served {
        tokens,
        positions,
        generated: answer.generated,
        seconds,
    })
}

/// The server's top-k per reference position (row `i` predicts token `i + 1`; the last prompt
/// position's is the first generated token's), after checking that the server took the prompt
/// as the ids sent.
fn positions(answer: &Answer, tokens: &[u32]) -> Result<Vec<TopK>, String> {
    let mismatch = |what: String| {
        format!("{what}: the server did not take the token ids as sent (another tokenizer or vocabulary?)")
    };
    if let Some(ids) = &answer.prompt_ids {
        if ids != tokens {
            let at = ids.iter().zip(tokens).position(|(a, b)| a != b);
            return Err(mismatch(match at {
                Some(i) => format!(
                    "prompt_token_ids[{i}] is {} where {} was sent",
                    ids[i], tokens[i]
                ),
                None => format!(
                    "prompt_token_ids holds {} ids where {} were sent",
                    ids.len(),
                    tokens.len()
                ),
            }));
        }
    }
    if answer.prompt_top.is_empty() {
        return Err(
            "choices[0].prompt_logprobs: no prompt log-probabilities in the answer (the server does not honour vLLM's prompt_logprobs)"
                .into(),
        );
    }
    if answer.prompt_top.len() != tokens.len() {
        return Err(mismatch(format!(
            "choices[0].prompt_logprobs has {} entries for {} tokens sent",
            answer.prompt_top.len(),
            tokens.len()
        )));
    }
    let mut rows = Vec::with_capacity(tokens.len());
    for (i, top) in answer.prompt_top.iter().enumerate().skip(1) {
        let Some(top) = top else {
            return Err(format!("choices[0].prompt_logprobs[{i}]: null"));
        };
        if !top.iter().any(|(id, _)| *id == tokens[i]) {
            return Err(mismatch(format!(
                "choices[0].prompt_logprobs[{i}] lacks the prompt's token {}",
                tokens[i]
            )));
        }
        rows.push(top.clone());
    }
    if let Some(Some(last)) = answer.generated_top.first() {
        rows.push(last.clone());
    }
    if rows.is_empty() {
        return Err("a one-token prompt without the first generated token's log-probabilities: nothing to compare".into());
    }
    Ok(rows)
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

/// The ColumnParallel weights `unsharded-column` takes, the story's `kv_b` first.
const COLUMN_WEIGHTS: &[&str] = &["kv_b", "q_b", "gate", "up", "shared_gate", "shared_up"];

/// Every split weight `shard-axis` and `rank-order` take.
const SPLIT_WEIGHTS: &[&str] = &[
    "kv_b",
    "q_b",
    "o_proj",
    "gate",
    "up",
    "down",
    "shared_gate",
    "shared_up",
    "shared_down",
];

/// The faults without a TP, in the order tried: the loader's first, then the ops'.
const SINGLE_RANK: &[&str] = &[
    "kv-b-split-order",
    "dequant-q4k-scales",
    "rope-neox",
    "indexer-rope-neox",
    "router-softmax",
    "routed-scale-twice",
    "flat-lm-head",
    "nan-expert",
    "fp16-overflow",
];

/// Whether any weight of the model is stored as Q4_K (else `dequant-q4k-scales` changes
/// nothing).
fn has_q4k(model: &Model) -> bool {
    let (src, cfg) = (model.source(), &model.cfg);
    stage_names(cfg).iter().any(|s| {
        stage_weights(cfg, s)
            .into_iter()
            .any(|id| src.storage_type(id) == Some(GgmlType::Q4_K))
    })
}

/// The faults to try, likeliest and cheapest first, and the catalogue's faults left out with
/// why. At TP ≥ 2 the ColumnParallel weights loaded whole (the story's loader bug) come first,
/// then the loader's TP-free faults, the other shard layouts, the all-reduces, the ops.
fn hypotheses(model: &Model, tp: Option<u64>, dtype: Precision) -> (Vec<Injection>, Vec<String>) {
    let degree = tp.unwrap_or(1);
    let mut specs: Vec<String> = Vec::new();
    let mut not_tried = Vec::new();
    if degree >= 2 {
        specs.extend(
            COLUMN_WEIGHTS
                .iter()
                .map(|w| format!("unsharded-column={w}")),
        );
        specs.extend(SINGLE_RANK[..2].iter().map(|s| s.to_string()));
        for name in ["rank-order", "shard-axis"] {
            specs.extend(SPLIT_WEIGHTS.iter().map(|w| format!("{name}={w}")));
        }
        specs.extend(["skip-all-reduce".into(), "double-all-reduce".into()]);
        specs.extend(SINGLE_RANK[2..].iter().map(|s| s.to_string()));
    } else {
        specs.extend(SINGLE_RANK.iter().map(|s| s.to_string()));
        let tp_faults: Vec<&str> = CATALOGUE
            .iter()
            .filter(|e| e.needs_tp)
            .map(|e| e.name)
            .collect();
        if !tp_faults.is_empty() {
            not_tried.push(format!(
                "{} not tried: they exist only with tensor parallelism, and {}",
                tp_faults.join(", "),
                match tp {
                    None => "--tp was not given (the server's TP is taken as 1; give --tp N for a server run with --tensor-parallel-size N)",
                    Some(_) => "the server runs at TP 1 (--tp 1)",
                }
            ));
        }
    }
    let q4k = has_q4k(model);
    let mut chosen = Vec::new();
    for spec in specs {
        let fault = Injection::parse(&spec).expect("every listed fault is in the catalogue");
        let e = fault.entry();
        if let Err(err) = fault.check(&model.cfg, degree as usize, dtype) {
            not_tried.push(format!("{spec} not tried: {err}"));
        } else if matches!(fault, Injection::DequantQ4kScales) && !q4k {
            not_tried.push(format!(
                "{} not tried: the model holds no Q4_K weight",
                e.name
            ));
        } else {
            chosen.push(fault);
        }
    }
    (chosen, not_tried)
}

/// A server that agrees with the reference: nothing run.
fn nothing_to_explain(e: &ExplainSpec) -> Explanation {
    Explanation {
        tp: e.tp.unwrap_or(1),
        dtype: e.dtype.name(),
        budget: e.budget,
        ranking: Vec::new(),
        best: None,
        runner_up: None,
        clean_score: None,
        verdict: ExplainVerdict::NothingToExplain,
        conclusion: "nothing to explain: the server agrees with the reference".into(),
        rule: EXPLAIN_RULE,
        not_tried: Vec::new(),
        failed: Vec::new(),
        seconds: 0.0,
    }
}

/// Every hypothesis (clean, then the faults in [`hypotheses`]'s order, up to the budget) run
/// on every served prompt and scored by its pooled [`fit`].
fn explain(model: &Model, served: &[Served], e: &ExplainSpec) -> anyhow::Result<Explanation> {
    let tp = e.tp.unwrap_or(1);
    let (faults, mut not_tried) = hypotheses(model, e.tp, e.dtype);
    let mut runs: Vec<Option<Injection>> = std::iter::once(None)
        .chain(faults.into_iter().map(Some))
        .collect();
    if let Some(budget) = e.budget {
        if runs.len() > budget {
            let left: Vec<String> = runs[budget..]
                .iter()
                .flatten()
                .map(Injection::spec)
                .collect();
            not_tried.push(format!(
                "{} not tried: past --budget {budget} ({})",
                left.len(),
                left.join(", ")
            ));
            runs.truncate(budget);
        }
    }
    let bar = crate::progress::progress(runs.len() as u64, e.quiet, "explain");
    let began = Instant::now();
    let mut ranking = Vec::new();
    let mut failed = Vec::new();
    for inject in runs {
        let name = inject.map_or_else(|| "clean".to_string(), |f| f.spec());
        bar.set_message(format!("explain: {name}"));
        let started = Instant::now();
        match score(model, served, inject, tp, e.dtype) {
            Ok(score) => ranking.push(Hypothesis {
                name,
                score,
                seconds: started.elapsed().as_secs_f64(),
            }),
            Err(err) if inject.is_some() => failed.push(format!("{name} could not run: {err:#}")),
            Err(err) => return Err(err.context("--explain: the clean model's run")),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    // Stable: equal scores keep the order they ran in, so clean stays ahead of a fault that
    // changes nothing.
    ranking.sort_by(|a, b| a.score.total_cmp(&b.score));
    let (verdict, conclusion) = Explanation::judge(&ranking);
    Ok(Explanation {
        tp,
        dtype: e.dtype.name(),
        budget: e.budget,
        best: ranking.first().cloned(),
        runner_up: ranking.get(1).cloned(),
        clean_score: ranking.iter().find(|h| h.name == "clean").map(|h| h.score),
        ranking,
        verdict,
        conclusion,
        rule: EXPLAIN_RULE,
        not_tried,
        failed,
        seconds: began.elapsed().as_secs_f64(),
    })
}

/// One hypothesis's pooled fit over every served prompt: the model run with `inject` at `tp`
/// and `dtype`, its prompt logits against the server's listed log-probabilities.
fn score(
    model: &Model,
    served: &[Served],
    inject: Option<Injection>,
    tp: u64,
    dtype: Precision,
) -> anyhow::Result<f64> {
    let (mut sum, mut terms) = (0.0, 0);
    for s in served {
        let dir = tempfile::tempdir().context("a temporary folder for a hypothesis's trace")?;
        let out = dir.path().join("hypothesis.trace");
        record(RunSpec {
            model,
            tokens: &s.tokens,
            out: &out,
            full: FullSelector::new(&["logits"])?,
            latent_norm_eps: model.cfg.rms_norm_eps,
            dtype,
            tp,
            ep: false,
            backend: BackendKind::Cpu,
            process: None,
            inject,
            generate: 0,
            warm_up: 0,
            ties: None,
            stored_as: None,
            hybrid: None,
        })?;
        let trace = Trace::open(&out)?;
        let Some((logits, shape)) = whole_values(&trace, "logits")? else {
            bail!("the run's trace holds no logits");
        };
        let vocab = *shape.last().unwrap_or(&1) as usize;
        let (s, n) = fit(&logits, vocab, &s.positions).map_err(|e| anyhow!(e))?;
        sum += s;
        terms += n;
    }
    Ok(sum / terms.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(ids: Option<Vec<u32>>, top: Vec<Option<TopK>>) -> Answer {
        Answer {
            prompt_ids: ids,
            prompt_top: top,
            generated: vec![7],
            generated_top: vec![Some(vec![(7, -0.1)])],
        }
    }

    #[test]
    fn rows_are_the_prompt_positions_then_the_first_generated_token() {
        let top = vec![
            None,
            Some(vec![(3, -0.2), (5, -3.0)]),
            Some(vec![(9, -0.5)]),
        ];
        let rows = positions(&answer(Some(vec![1, 5, 9]), top), &[1, 5, 9]).unwrap();
        assert_eq!(
            rows,
            vec![vec![(3, -0.2), (5, -3.0)], vec![(9, -0.5)], vec![(7, -0.1)]]
        );
    }

    #[test]
    fn ids_not_taken_as_sent_or_missing_log_probabilities_cannot_be_judged() {
        let top = vec![None, Some(vec![(3, -0.2)]), Some(vec![(9, -0.5)])];
        let e = positions(&answer(Some(vec![1, 6, 9]), top.clone()), &[1, 5, 9]).unwrap_err();
        assert!(
            e.starts_with("prompt_token_ids[1] is 6 where 5 was sent"),
            "{e}"
        );
        let e = positions(&answer(None, top), &[1, 5, 9]).unwrap_err();
        assert!(e.contains("lacks the prompt's token 5"), "{e}");
        let e = positions(&answer(None, vec![]), &[1, 5, 9]).unwrap_err();
        assert!(e.contains("no prompt log-probabilities"), "{e}");
    }
}
