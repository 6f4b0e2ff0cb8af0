//! `glmcheck gate --baseline FILE CAND`: a candidate (a trace, or a model run here) held to a
//! reviewed baseline; `--update` writes the baseline from the candidate instead.

use crate::engine::BackendKind;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::output::{num, table};
use super::Outcome;
use crate::compare::Status;
use crate::dtype::Precision;
use crate::exec::forward::HF_LATENT_NORM_EPS;
use crate::exec::inject::Injection;
use crate::gate::check::{Basis, GateReport};
use crate::gate::{self, Baseline};
use crate::pipeline::bisect::DEFAULT_PROMPT;
use crate::pipeline::record::{prompt_tokens, record, RunSpec};
use crate::pipeline::Model;
use crate::trace::{FullSelector, Trace, DEFAULT_FULL};

#[derive(clap::Args, Debug)]
pub struct GateArgs {
    /// The baseline JSON (e.g. `golden/tiny-f32-tp2.json`).
    #[arg(long, value_name = "FILE")]
    pub baseline: PathBuf,
    /// The candidate: a trace folder (`NAME.trace`), or a model (GGUF, Hugging Face folder) to
    /// run here with the options below.
    pub candidate: PathBuf,
    /// Write (or overwrite) the baseline from the candidate instead of checking it.
    #[arg(long)]
    pub update: bool,
    /// Also write the verdict as JUnit XML (one testcase per stage record).
    #[arg(long, value_name = "OUT.xml")]
    pub junit: Option<PathBuf>,
    /// Also write the verdict as Markdown for a CI job summary.
    #[arg(long, value_name = "OUT.md")]
    pub markdown: Option<PathBuf>,
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Model candidate: its dtype (default: the baseline's, else f32).
    #[arg(long, value_enum)]
    pub dtype: Option<Precision>,
    /// Model candidate: tensor-parallel ranks (default: the baseline's, else 1).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: Option<u64>,
    /// Model candidate: expert parallelism (default: the baseline's).
    #[arg(long)]
    pub ep: bool,
    /// Model candidate: where its ops run (`cpu`, or `cuda`: one GPU per rank).
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// Model candidate: plant a fault of the catalogue (`glmcheck bisect --list-faults`).
    #[arg(long, value_name = "FAULT[=ARG]", value_parser = Injection::parse)]
    pub inject: Option<Injection>,
    /// Model candidate: prompt token ids (default: the baseline's).
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
    pub tokens: Vec<u32>,
    /// Model candidate: prompt text through the model's tokenizer (default: the baseline's
    /// tokens, else "The capital of France is").
    #[arg(long)]
    pub prompt: Option<String>,
    /// Model candidate: eps of the q_a/kv_a RMSNorms (default: the baseline's, else 1e-6).
    #[arg(long)]
    pub latent_norm_eps: Option<f64>,
    /// Model candidate: keep its trace here (`NAME.trace`) instead of a temporary folder.
    #[arg(long, value_name = "NAME.trace")]
    pub out: Option<PathBuf>,
}

/// Whether `path` is a trace folder rather than a model.
fn is_trace(path: &Path) -> bool {
    path.join(crate::trace::manifest::MANIFEST_NAME).is_file()
}

/// Run the model candidate as the baseline (or the options) say, into `out`.
fn record_candidate(
    args: &GateArgs,
    baseline: Option<&Baseline>,
    out: &Path,
) -> anyhow::Result<()> {
    let model = Model::open(&args.candidate)?;
    let prompt = match (&args.prompt, args.tokens.is_empty(), baseline) {
        (Some(p), _, _) => Some(p.clone()),
        (None, false, _) | (None, true, Some(_)) => None,
        (None, true, None) => Some(DEFAULT_PROMPT.to_string()),
    };
    let ids = match (args.tokens.is_empty(), baseline) {
        (true, Some(b)) => b.tokens.clone(),
        _ => args.tokens.clone(),
    };
    let (tokens, _) = prompt_tokens(&model.files, prompt.as_deref(), &ids)?;
    let dtype = match (args.dtype, baseline) {
        (Some(d), _) => d,
        (None, Some(b)) => Precision::from_name(&b.dtype)?,
        (None, None) => Precision::F32,
    };
    let tp = args.tp.or(baseline.map(|b| u64::from(b.tp))).unwrap_or(1);
    let ep = args.ep || baseline.is_some_and(|b| b.ep);
    let latent_norm_eps = args
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
        backend: args.backend,
        process: None,
        inject: args.inject,
        generate: 0,
        warm_up: 0,
        ties: ties.as_ref().filter(|t| t.count() > 0),
        stored_as: None,
        hybrid: None,
    })?;
    Ok(())
}

pub fn run(args: GateArgs) -> anyhow::Result<Outcome> {
    let baseline = if args.update {
        None
    } else {
        Some(Baseline::load(&args.baseline)?)
    };
    let model_only = [
        ("--dtype", args.dtype.is_some()),
        ("--tp", args.tp.is_some()),
        ("--ep", args.ep),
        ("--inject", args.inject.is_some()),
        ("--tokens", !args.tokens.is_empty()),
        ("--prompt", args.prompt.is_some()),
        ("--latent-norm-eps", args.latent_norm_eps.is_some()),
        ("--out", args.out.is_some()),
    ];
    let scratch = tempfile::tempdir().context("a temporary folder for the candidate's trace")?;
    let trace_dir = if is_trace(&args.candidate) {
        if let Some((flag, _)) = model_only.iter().find(|(_, given)| *given) {
            bail!(
                "{}: {flag} applies to a model candidate, and this is a trace",
                args.candidate.display()
            );
        }
        args.candidate.clone()
    } else {
        if !args.candidate.exists() {
            bail!("{}: no such trace or model", args.candidate.display());
        }
        let out = args
            .out
            .clone()
            .unwrap_or_else(|| scratch.path().join("candidate.trace"));
        record_candidate(&args, baseline.as_ref(), &out)?;
        out
    };
    let trace = Trace::open(&trace_dir).with_context(|| trace_dir.display().to_string())?;

    let Some(baseline) = baseline else {
        let made = Baseline::from_trace(&trace, &args.candidate.display().to_string())?;
        if let Some(parent) = args.baseline.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("{}: creating the folder", parent.display()))?;
        }
        std::fs::write(&args.baseline, made.to_json())
            .with_context(|| format!("{}: writing the baseline", args.baseline.display()))?;
        if args.json {
            println!(
                "{}",
                serde_json::json!({"updated": args.baseline, "stages": made.stages.len(),
                    "dtype": made.dtype, "tp": made.tp, "epsilon": made.limits.epsilon,
                    "fingerprint": made.model.fingerprint})
            );
        } else {
            println!(
                "wrote {}: {} stage records, {} at TP {}, ε = {:.3e}",
                args.baseline.display(),
                made.stages.len(),
                made.dtype,
                made.tp,
                made.limits.epsilon
            );
        }
        return Ok(Outcome::Pass);
    };

    let shown = if is_trace(&args.candidate) {
        args.candidate.display().to_string()
    } else {
        format!("{} (run here)", args.candidate.display())
    };
    let mut report = gate::check(&baseline, &trace, &args.baseline.display().to_string())?;
    report.candidate = shown;
    let taken = baseline.tie_breaks().count();
    if taken > 0 && !is_trace(&args.candidate) {
        report.notes.push(format!(
            "{taken} top-k positions were near ties in the baseline's run; the candidate run took the baseline's choice there"
        ));
    }
    if let Some(out) = &args.junit {
        let suite = args
            .baseline
            .file_stem()
            .map_or("baseline".into(), |s| s.to_string_lossy().into_owned());
        std::fs::write(out, gate::junit::junit(&report, &suite))
            .with_context(|| format!("{}: writing the JUnit report", out.display()))?;
    }
    if let Some(out) = &args.markdown {
        std::fs::write(out, gate::markdown::markdown(&report))
            .with_context(|| format!("{}: writing the Markdown summary", out.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(Outcome::of(report.regressed(), report.partial))
}

/// The verdict in one word: a partial candidate whose stages held is `PARTIAL`, never a pass.
fn headline(r: &GateReport) -> &'static str {
    match (r.verdict, r.regressed()) {
        (Status::Pass, _) => "PASS",
        (Status::Fail, true) => "REGRESSION",
        (Status::Fail, false) => "PARTIAL",
    }
}

/// A float with the digits that tell baseline and candidate apart.
fn full(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.9e}"))
}

fn print_report(r: &GateReport) {
    let identical = r
        .stages
        .iter()
        .filter(|s| s.basis == Basis::Identical)
        .count();
    println!(
        "{}: {} against {} ({}, TP {}, ε = {:.3e}): {} of {} checks broke; {identical} stage records bit-identical",
        headline(r),
        r.candidate,
        r.baseline,
        r.dtype,
        r.tp,
        r.epsilon,
        r.failed,
        r.checked
    );
    if r.failed > 0 {
        let mut t = table(&["stage", "check", "baseline", "candidate", "limit", "why"]);
        for s in r.failures() {
            for f in &s.failures {
                t.add_row(vec![
                    s.label(),
                    f.check.clone(),
                    full(f.baseline),
                    full(f.candidate),
                    f.limit.map_or("-".into(), num),
                    f.why.clone(),
                ]);
            }
        }
        println!("{t}");
        if let Some(first) = r.failures().next() {
            println!("first broken stage: {}", first.label());
        }
    } else {
        // How close the candidate came: the stages nearest their limits.
        let mut near: Vec<_> = r.stages.iter().filter(|s| s.headroom_used > 0.0).collect();
        near.sort_by(|a, b| b.headroom_used.total_cmp(&a.headroom_used));
        if !near.is_empty() {
            let mut t = table(&["stage", "closest check", "share of its limit used"]);
            for s in near.iter().take(5) {
                t.add_row(vec![
                    s.label(),
                    s.closest.clone().unwrap_or_default(),
                    format!("{:.1}%", 100.0 * s.headroom_used),
                ]);
            }
            println!("{t}");
        }
    }
    for n in &r.notes {
        println!("note: {n}");
    }
    if r.extra_stages > 0 {
        println!(
            "note: the candidate records {} stage records the baseline does not (not judged)",
            r.extra_stages
        );
    }
}
