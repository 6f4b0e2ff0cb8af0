//! `glmcheck run MODEL --tokens IDS --out TRACE`: the CPU reference forward, recorded as a trace.

use std::path::PathBuf;
use std::time::Duration;

use super::{one_of, Outcome};
use crate::any_backend::BackendKind;
use crate::cuda::ranks::ProcessRank;
use crate::dtype::Precision;
use crate::exec::faults::inject::Injection;
use crate::exec::forward::HF_LATENT_NORM_EPS;
use crate::model::tokenize;
use crate::pipeline::record::{prompt_tokens, record, Recorded, RunSpec};
use crate::pipeline::Model;
use crate::report::run::{Profile, RunReport};
use crate::trace::FullSelector;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// A GGUF or Hugging Face folder of the MLA/MoE family (GLM-5, GLM-4.7-Flash, DeepSeek-V2,
    /// V3, V3.2, Kimi-K2).
    pub model: PathBuf,
    /// Prompt token ids, comma-separated (`--tokens 1,5,9`).
    #[arg(
        long,
        value_delimiter = ',',
        required_unless_present = "prompt",
        conflicts_with = "prompt"
    )]
    pub tokens: Vec<u32>,
    /// Prompt text, tokenized with the model's tokenizer (GGUF `tokenizer.ggml.*` or
    /// `tokenizer.json`); generated tokens are decoded back to text.
    #[arg(long)]
    pub prompt: Option<String>,
    /// The trace folder to write (`NAME.trace`).
    #[arg(long)]
    pub out: PathBuf,
    /// Stages stored as full tensors (repeatable globs; `*` stays within a dotted part, `**`
    /// crosses them). Default: `logits` and `L*.out`; every stage keeps its statistics.
    #[arg(long = "full", value_name = "GLOB")]
    pub full: Vec<String>,
    /// Eps of the q_a/kv_a RMSNorms: transformers builds them with 1e-6, vLLM and llama.cpp use
    /// the config's `rms_norm_eps`.
    #[arg(long, default_value_t = HF_LATENT_NORM_EPS)]
    pub latent_norm_eps: f64,
    /// Precision: f32 (the reference), f64 (how much of a difference is the reference's own
    /// rounding), or bf16/f16 emulating a GPU engine (weights and every op's output rounded to
    /// the dtype, f32 accumulation, f32 router).
    #[arg(long, default_value = "f32", value_parser = one_of(&Precision::ALL, Precision::name))]
    pub dtype: Precision,
    /// Tensor-parallel ranks, split as vLLM splits GLM-5 (`glmcheck shards`): threads on the
    /// CPU, one GPU each with `--backend cuda`. Per-rank stages are recorded with their rank.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: u64,
    /// Where the ops run: `cpu`, or `cuda` (GPUs 0..TP, cuBLAS GEMMs, NCCL all-reduce; CUDA 13
    /// libraries loaded at run time).
    #[arg(long, default_value = "cpu", value_parser = one_of(&BackendKind::ALL, BackendKind::name))]
    pub backend: BackendKind,
    /// One process per rank (`--backend cuda`): this process's rank, on GPU RANK. Start one
    /// process per rank with the same arguments and `--nccl-id`; rank 0 writes the trace.
    #[arg(long, requires_all = ["world_size", "nccl_id"])]
    pub rank: Option<usize>,
    /// The number of rank processes (equal to `--tp`).
    #[arg(long, requires = "rank")]
    pub world_size: Option<usize>,
    /// A file on storage every rank process sees: rank 0 writes the NCCL unique id there, the
    /// others wait for it (remove it before a new run).
    #[arg(long, value_name = "FILE", requires = "rank")]
    pub nccl_id: Option<PathBuf>,
    /// One process per rank: the longest a rank waits for another, at the start or at any
    /// collective; a rank that is gone longer (killed, crashed) ends the others with an error
    /// naming it. Heartbeats go to `FILE.rankR` beside the `--nccl-id` file.
    #[arg(long, value_name = "SECS", default_value_t = 300, requires = "rank",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub rank_timeout: u64,
    /// Expert parallelism: each rank computes the routed experts it owns whole (experts
    /// `r·E/tp .. (r+1)·E/tp`) instead of its share of every expert's intermediate dimension.
    #[arg(long)]
    pub ep: bool,
    /// Plant a fault from the catalogue (`glmcheck bisect --list-faults`), as `NAME[=ARG]`:
    /// the run is then a candidate with a known bug.
    #[arg(long, value_name = "FAULT[=ARG]", value_parser = Injection::parse)]
    pub inject: Option<Injection>,
    /// Greedy-generate this many tokens after the prompt (through a KV cache; only the prompt is
    /// traced).
    #[arg(long, default_value_t = 0)]
    pub generate: usize,
    /// Forward passes run first and left unrecorded: on the GPUs they leave the weights they
    /// read resident, and their stages are taken as the recorded pass takes them and dropped,
    /// so the recorded pass times the forward without loading or first allocations
    /// (benchmarks).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warm_up: usize,
    /// After the run, where the recorded pass spent its time: each backend op's calls and
    /// seconds, and the stages' recording (the trace's `producer.op_seconds` has them always).
    #[arg(long)]
    pub profile: bool,
    /// Print the top-1 token of every position as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: RunArgs) -> anyhow::Result<Outcome> {
    let model = Model::open(&args.model)?;
    let (tokens, tokenizer) = prompt_tokens(&model.files, args.prompt.as_deref(), &args.tokens)?;
    let full = if args.full.is_empty() {
        FullSelector::default()
    } else {
        FullSelector::new(&args.full)?
    };
    let Recorded {
        top1,
        generated,
        op_times,
        pass_seconds,
    } = record(RunSpec {
        model: &model,
        tokens: &tokens,
        out: &args.out,
        full,
        latent_norm_eps: args.latent_norm_eps,
        dtype: args.dtype,
        tp: args.tp,
        ep: args.ep,
        backend: args.backend,
        process: match (args.rank, args.world_size, &args.nccl_id) {
            (Some(rank), Some(world_size), Some(file)) => Some(ProcessRank {
                rank,
                world_size,
                nccl_id: file.clone(),
                timeout: Duration::from_secs(args.rank_timeout),
            }),
            _ => None,
        },
        inject: args.inject,
        generate: args.generate,
        warm_up: args.warm_up,
        ties: None,
        stored_as: None,
        hybrid: None,
    })?;
    let text = match &tokenizer {
        Some(tok) if !generated.is_empty() => Some(tokenize::decode(tok, &generated)?),
        _ => None,
    };
    let report = RunReport {
        generated,
        profile: args.profile.then(|| Profile::new(&op_times, pass_seconds)),
        text,
        tokens,
        top1,
        trace: args.out,
        prompt: args.prompt,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.text());
    }
    Ok(Outcome::Pass)
}
