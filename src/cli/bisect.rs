//! `glmcheck bisect MODEL`: the one-shot diagnosis (the pipeline is
//! [`crate::pipeline::bisect`]); this module parses its arguments and prints its report.

use std::path::PathBuf;

use anyhow::{bail, Context};

use super::diff::print_report;
use super::{one_of, Outcome};
use crate::any_backend::BackendKind;
use crate::compare::Status;
use crate::diagnose::settings;
use crate::dtype::Precision;
use crate::exec::faults::inject::Injection;
use crate::exec::faults::inject::CATALOGUE;
use crate::exec::forward::HF_LATENT_NORM_EPS;
use crate::pipeline::bisect::{
    bisect, is_trace, BisectOptions, BisectReport, Candidate, Mode, PathInfo, RunAs, WeightCheck,
};
use crate::report::terminal::table;

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
    /// Where the candidate's ops run: `cpu`, or `cuda` (one GPU per rank, cuBLAS, NCCL).
    #[arg(long, default_value = "cpu", value_parser = one_of(&BackendKind::ALL, BackendKind::name))]
    pub backend: BackendKind,
    /// Where the reference and its envelope run (TP 1): `cpu`, or `cuda` on GPU 0, in f32
    /// within the f32 tolerance (1e-8 `rel_diff`) of the CPU's, so that a large model's
    /// reference does not wait on the host's cores.
    #[arg(long, default_value = "cpu", value_parser = one_of(&BackendKind::ALL, BackendKind::name))]
    pub reference_backend: BackendKind,
    /// The candidate's dtype; bf16/f16 are judged against the reference re-run at that dtype.
    #[arg(long, default_value = "f32", value_parser = one_of(&Precision::ALL, Precision::name))]
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
    #[arg(long, default_value = "auto", value_parser = one_of(&WeightCheck::ALL, WeightCheck::name))]
    pub weights: WeightCheck,
    /// `stages`: compare every stage both sides record. `logits`: judge the candidate by its
    /// logits alone, as an engine exposing nothing else, and find the first faulty layer by
    /// hybrid runs (the candidate up to a layer, the reference after it; O(log L) runs).
    #[arg(long, default_value = "stages", value_parser = one_of(&Mode::ALL, Mode::name))]
    pub mode: Mode,
    /// List the fault catalogue (name, ARG, class and stage a correct diagnosis gives).
    #[arg(long)]
    pub list_faults: bool,
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

impl BisectArgs {
    /// The pipeline's options (MODEL is required unless `--list-faults`). A `--candidate` that
    /// is a trace folder is an engine's trace, which takes no planted fault and no hybrid runs.
    pub fn options(self) -> anyhow::Result<BisectOptions> {
        let run_as = RunAs {
            tp: self.tp,
            ep: self.ep,
            backend: self.backend,
            dtype: self.dtype,
            inject: self.inject,
        };
        let candidate = match self.candidate {
            Some(trace) if is_trace(&trace) => {
                if self.inject.is_some() {
                    bail!(
                        "--inject plants a fault in a run glmcheck makes; --candidate TRACE is an engine's"
                    );
                }
                Candidate::EngineTrace(trace)
            }
            Some(model) => Candidate::Checkpoint(model, run_as),
            None => Candidate::Run(run_as),
        };
        Ok(BisectOptions {
            model: self.model.context("MODEL is required")?,
            candidate,
            reference_backend: self.reference_backend,
            prompt: self.prompt,
            tokens: self.tokens,
            generate: self.generate,
            latent_norm_eps: self.latent_norm_eps,
            actual: self.actual,
            out: self.out,
            weights: self.weights,
            mode: self.mode,
            quiet: self.json,
        })
    }
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
        "\nnamed from the settings an engine trace records (the GGUF metadata llama.cpp read, \
         the config.json vLLM or transformers took), not planted:"
    );
    let mut t = table(&[
        "GGUF key",
        "config field",
        "class",
        "first divergence",
        "what",
    ]);
    for k in &settings::KEYS {
        t.add_row(vec![
            k.key.map_or("-".to_string(), |k| format!("<arch>.{k}")),
            k.fields
                .iter()
                .map(|f| settings::config_name(f))
                .collect::<Vec<_>>()
                .join(" / "),
            k.class.name().to_string(),
            k.stages.join(" or "),
            k.does.to_string(),
        ]);
    }
    println!("{t}");
    Ok(Outcome::Pass)
}

pub fn run(args: BisectArgs) -> anyhow::Result<Outcome> {
    if args.list_faults {
        return list_faults(args.json);
    }
    let json = args.json;
    let out = bisect(&args.options()?)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print_bisect(&out);
    }
    Ok(match out.diff.verdict {
        Status::Pass => Outcome::Pass,
        Status::Fail => Outcome::Fail,
    })
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
            "the tensors behind the divergent stage"
        };
        println!(
            "weight check ({which}): {} tensors, {} exact (ggml's bytes), {} within their type's \
             noise, {} failed; {:.1} MiB of the file read in {:.1} s",
            w.tensors,
            w.exact,
            w.within_noise,
            w.failed,
            w.bytes_read as f64 / (1u64 << 20) as f64,
            w.seconds
        );
    }
    let behind = |p: &&PathInfo| !p.hidden.is_empty() || !p.statistics_only.is_empty();
    if let Some(p) = b.path.as_ref().filter(behind) {
        if !p.hidden.is_empty() {
            println!(
                "behind {}: the engine's trace holds no {}",
                p.divergent,
                p.hidden.join(", ")
            );
        }
        if !p.statistics_only.is_empty() {
            println!(
                "behind {}: kept as statistics only, which a permutation or a sign leaves as \
                 they were: {}",
                p.divergent,
                p.statistics_only.join(", ")
            );
        }
        if !p.tensors.is_empty() || !p.keys.is_empty() {
            let checked: Vec<&str> = p
                .tensors
                .iter()
                .chain(&p.keys)
                .map(String::as_str)
                .collect();
            println!("  checked for them: {}", checked.join(", "));
        }
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
                "engine config" => "from the config.json the engine took",
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
