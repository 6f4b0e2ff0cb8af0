//! `glmcheck endpoint --explain`: which catalogued fault, or which config key read wrong, best
//! explains what the server said.

use std::time::Instant;

use anyhow::{anyhow, bail, Context};

use super::super::record::{record, RunSpec};
use super::super::Model;
use super::misread::{misreads, Misread};
use super::{ExplainSpec, Served};
use crate::any_backend::BackendKind;
use crate::compare::stage_diff::whole_values;
use crate::compare::top_k::fit;
use crate::dtype::Precision;
use crate::exec::faults::inject::{Injection, CATALOGUE};
use crate::model::stages::{stage_names, stage_weights};
use crate::report::endpoint::{ExplainVerdict, Explanation, Hypothesis, EXPLAIN_RULE};
use crate::trace::{FullSelector, Trace};
use crate::weights::GgmlType;

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

/// One hypothesis: the model as it is, a catalogued fault planted, or a config key read wrong.
enum Run {
    Clean,
    Fault(Injection),
    Config(Box<Misread>),
}

impl Run {
    fn name(&self) -> String {
        match self {
            Run::Clean => "clean".into(),
            Run::Fault(f) => f.spec(),
            Run::Config(m) => m.name.clone(),
        }
    }
}

/// The catalogue's faults that take a layer, tried again at each layer (after every other
/// hypothesis): which layer's all-reduce, which MoE layer's expert.
const PER_LAYER: &[&str] = &["skip-all-reduce", "double-all-reduce", "nan-expert"];

/// The hypotheses to try, likeliest and cheapest first, and the catalogue's faults left out
/// with why. At TP ≥ 2 the ColumnParallel weights loaded whole (the story's loader bug) come
/// first; then the loader's TP-free faults, the config keys a loader could misread, the other
/// shard layouts, the all-reduces, the ops, and last the layer-taking faults at each layer.
fn hypotheses(model: &Model, tp: Option<u64>, dtype: Precision) -> (Vec<Run>, Vec<String>) {
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
    // Each layer but the one the default already takes (nan-expert's first MoE layer; the
    // all-reduces' every layer, the same as layer 0 in a one-layer model).
    let (layers, first_moe) = (model.cfg.num_hidden_layers, model.cfg.first_k_dense_replace);
    let per_layer: Vec<String> = PER_LAYER
        .iter()
        .filter(|name| specs.iter().any(|s| s == *name))
        .flat_map(|name| {
            (0..layers)
                .filter(move |&l| match *name {
                    "nan-expert" => l != first_moe,
                    _ => layers > 1,
                })
                .map(move |l| format!("{name}={l}"))
        })
        .collect();
    specs.extend(per_layer);
    let q4k = has_q4k(model);
    let mut chosen = Vec::new();
    let mut layer_skips = 0;
    for spec in specs {
        let fault = Injection::parse(&spec).expect("every listed fault is in the catalogue");
        let e = fault.entry();
        if let Err(err) = fault.check(&model.cfg, degree as usize, dtype) {
            // A layer-taking fault where it cannot be (a dense layer's expert) is no news.
            if spec.contains('=') && PER_LAYER.contains(&e.name) {
                layer_skips += 1;
            } else {
                not_tried.push(format!("{spec} not tried: {err}"));
            }
        } else if matches!(fault, Injection::DequantQ4kScales) && !q4k {
            not_tried.push(format!(
                "{} not tried: the model holds no Q4_K weight",
                e.name
            ));
        } else {
            chosen.push(Run::Fault(fault));
        }
    }
    if layer_skips > 0 {
        not_tried.push(format!(
            "{layer_skips} per-layer hypotheses not tried: the layer has no such piece (a dense layer's experts)"
        ));
    }
    // The config misreads go after the loader's faults that come first.
    let loader_first = chosen
        .iter()
        .take_while(|r| match r {
            Run::Fault(f) => LOADER_FIRST.contains(&f.entry().name),
            _ => false,
        })
        .count();
    let configs = misreads(&model.cfg)
        .into_iter()
        .map(|m| Run::Config(Box::new(m)));
    chosen.splice(loader_first..loader_first, configs);
    (chosen, not_tried)
}

/// The loader's faults tried before the config misreads.
const LOADER_FIRST: &[&str] = &["unsharded-column", "kv-b-split-order", "dequant-q4k-scales"];

/// A server that agrees with the reference: nothing run.
pub(super) fn nothing_to_explain(e: &ExplainSpec) -> Explanation {
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
pub(super) fn explain(
    model: &Model,
    served: &[Served],
    e: &ExplainSpec,
) -> anyhow::Result<Explanation> {
    let tp = e.tp.unwrap_or(1);
    let (faults, mut not_tried) = hypotheses(model, e.tp, e.dtype);
    let mut runs: Vec<Run> = std::iter::once(Run::Clean).chain(faults).collect();
    if let Some(budget) = e.budget {
        if runs.len() > budget {
            let left: Vec<String> = runs[budget..].iter().map(Run::name).collect();
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
    for run in runs {
        let name = run.name();
        bar.set_message(format!("explain: {name}"));
        let started = Instant::now();
        match score(model, served, &run, tp, e.dtype) {
            Ok(score) => ranking.push(Hypothesis {
                name,
                score,
                seconds: started.elapsed().as_secs_f64(),
            }),
            Err(err) if !matches!(run, Run::Clean) => {
                failed.push(format!("{name} could not run: {err:#}"))
            }
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

/// One hypothesis's pooled fit over every served prompt: the model run as `run` says at `tp`
/// and `dtype`, its prompt logits against the server's listed log-probabilities.
fn score(
    model: &Model,
    served: &[Served],
    run: &Run,
    tp: u64,
    dtype: Precision,
) -> anyhow::Result<f64> {
    let misread;
    let (model, inject) = match run {
        Run::Clean => (model, None),
        Run::Fault(f) => (model, Some(*f)),
        Run::Config(m) => {
            misread = Model {
                files: model.files.clone(),
                cfg: m.cfg.clone(),
                family: model.family,
            };
            (&misread, None)
        }
    };
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
