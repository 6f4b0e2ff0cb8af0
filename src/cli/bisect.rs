//! `glmcheck bisect MODEL`: the one-shot diagnosis (the pipeline is
//! [`crate::pipeline::bisect`]); this module parses its arguments and prints its report.

use std::path::PathBuf;

use anyhow::{bail, Context};

use super::{one_of, Outcome};
use crate::any_backend::BackendKind;
use crate::dtype::Precision;
use crate::exec::faults::inject::Injection;
use crate::exec::faults::inject::CATALOGUE;
use crate::exec::forward::HF_LATENT_NORM_EPS;
use crate::pipeline::bisect::{
    bisect, is_trace, BisectOptions, Candidate, Mode, RunAs, WeightCheck,
};
use crate::report::bisect::{catalogue_text, text};

#[derive(clap::Args, Debug)]
pub struct BisectArgs {
    /// A GGUF or Hugging Face folder of the family (GLM-5, DeepSeek-V2/V3/V3.2, Kimi-K2,
    /// GLM-4.7-Flash): the reference, and the candidate unless `--candidate` names another.
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
    /// run with the options above, a TRACE an engine probe wrote, or a folder of SGLang's own
    /// dumps (probes/sglang/README.md); for a trace or dump the prompt is its tokens.
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
    } else {
        print!("{}", catalogue_text());
    }
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
        print!("{}", text(&out));
    }
    Ok(out.diff.verdict.into())
}
