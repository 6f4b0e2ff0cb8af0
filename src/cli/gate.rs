//! `glmcheck gate --baseline FILE CAND`: a candidate (a trace, or a model run here) held to a
//! reviewed baseline; `--update` writes the baseline from the candidate instead.

use crate::any_backend::BackendKind;
use std::path::PathBuf;

use anyhow::Context;

use super::{one_of, Outcome};
use crate::compare::Status;
use crate::dtype::Precision;
use crate::exec::faults::inject::Injection;
use crate::gate::check::{Basis, GateReport};
use crate::gate::{self, Baseline};
use crate::pipeline::gate::{candidate_trace, check, ModelRun};
use crate::report::num;
use crate::report::terminal::table;
use crate::trace::Trace;

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
    #[arg(long, value_parser = one_of(&Precision::ALL, Precision::name))]
    pub dtype: Option<Precision>,
    /// Model candidate: tensor-parallel ranks (default: the baseline's, else 1).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: Option<u64>,
    /// Model candidate: expert parallelism (default: the baseline's).
    #[arg(long)]
    pub ep: bool,
    /// Model candidate: where its ops run (`cpu`, or `cuda`: one GPU per rank).
    #[arg(long, default_value = "cpu", value_parser = one_of(&BackendKind::ALL, BackendKind::name))]
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

pub fn run(args: GateArgs) -> anyhow::Result<Outcome> {
    let baseline = if args.update {
        None
    } else {
        Some(Baseline::load(&args.baseline)?)
    };
    let run = ModelRun {
        dtype: args.dtype,
        tp: args.tp,
        ep: args.ep,
        backend: args.backend,
        inject: args.inject,
        tokens: args.tokens.clone(),
        prompt: args.prompt.clone(),
        latent_norm_eps: args.latent_norm_eps,
        out: args.out.clone(),
    };
    let scratch = tempfile::tempdir().context("a temporary folder for the candidate's trace")?;
    let trace_dir = candidate_trace(&args.candidate, &run, baseline.as_ref(), scratch.path())?;
    let trace = Trace::open(&trace_dir)?;

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

    let report = check(&baseline, &args.baseline, &args.candidate, &trace)?;
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
