//! `glmcheck gate --baseline FILE CAND`: a candidate (a trace, or a model run here) held to a
//! reviewed baseline; `--update` writes the baseline from the candidate instead.

use crate::any_backend::BackendKind;
use std::path::PathBuf;

use anyhow::Context;

use super::{one_of, Outcome};
use crate::dtype::Precision;
use crate::exec::faults::inject::Injection;
use crate::gate::Baseline;
use crate::pipeline::gate::{candidate_trace, check, ModelRun};
use crate::pipeline::Model;
use crate::report::gate::junit::junit;
use crate::report::gate::markdown::markdown;
use crate::report::gate::{text, Updated};
use crate::trace::{sglang, Trace};

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
    /// SGLang dump candidate: the checkpoint SGLang served, whose config cuts the ranks' parts
    /// (default: the model the baseline names).
    #[arg(long, value_name = "MODEL")]
    pub model: Option<PathBuf>,
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
    let trace = match sglang::is_dump(&trace_dir) {
        true => {
            let named = baseline.as_ref().map(|b| PathBuf::from(&b.model.source));
            let path = args.model.clone().or(named).context(
                "an SGLang dump is read against the checkpoint SGLang served: give --model MODEL",
            )?;
            let model = Model::open(&path)?;
            sglang::open_candidate(&trace_dir, &model.cfg, model.run_info())?
        }
        false => Trace::open(&trace_dir)?,
    };

    let Some(baseline) = baseline else {
        let made = Baseline::from_trace(&trace, &args.candidate.display().to_string())?;
        if let Some(parent) = args.baseline.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("{}: creating the folder", parent.display()))?;
        }
        std::fs::write(&args.baseline, made.to_json())
            .with_context(|| format!("{}: writing the baseline", args.baseline.display()))?;
        let updated = Updated::new(args.baseline.clone(), &made);
        if args.json {
            println!("{}", serde_json::to_string(&updated)?);
        } else {
            print!("{}", updated.text());
        }
        return Ok(Outcome::Pass);
    };

    let report = check(&baseline, &args.baseline, &args.candidate, &trace)?;
    if let Some(out) = &args.junit {
        let suite = args
            .baseline
            .file_stem()
            .map_or("baseline".into(), |s| s.to_string_lossy().into_owned());
        std::fs::write(out, junit(&report, &suite))
            .with_context(|| format!("{}: writing the JUnit report", out.display()))?;
    }
    if let Some(out) = &args.markdown {
        std::fs::write(out, markdown(&report))
            .with_context(|| format!("{}: writing the Markdown summary", out.display()))?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }
    Ok(Outcome::of(report.regressed(), report.partial))
}
