//! `glmcheck run MODEL --tokens IDS --out TRACE`: the CPU reference forward, recorded as a trace.

use std::path::PathBuf;

use anyhow::{bail, Context};
use serde_json::json;

use super::inspect::glm5_config;
use super::Outcome;
use crate::exec::backend::{Backend, Cpu, Precision};
use crate::exec::forward::{generate, ForwardOptions, HF_LATENT_NORM_EPS};
use crate::exec::inject::Injection;
use crate::exec::ops::topk;
use crate::exec::source::WeightSource;
use crate::exec::tokenize;
use crate::trace::{stats::fnv1a_bytes, FullSelector, ModelInfo, TraceHeader, TraceWriter};
use crate::weights::ModelFiles;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// A GLM-5 GGUF or Hugging Face folder.
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
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Precision,
    /// Tensor-parallel ranks, split as vLLM splits GLM-5 (`glmcheck shards`) and run on the CPU
    /// one after another: per-rank stages are recorded with their rank.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: u64,
    /// Plant a fault from the catalogue (`glmcheck bisect --list-faults`), as `NAME[=ARG]`:
    /// the run is then a candidate with a known bug.
    #[arg(long, value_name = "FAULT[=ARG]", value_parser = Injection::parse)]
    pub inject: Option<Injection>,
    /// Greedy-generate this many tokens after the prompt (through a KV cache; only the prompt is
    /// traced).
    #[arg(long, default_value_t = 0)]
    pub generate: usize,
    /// Print the top-1 token of every position as JSON.
    #[arg(long)]
    pub json: bool,
}

/// A digest of the weights' names, types and shapes (not their bytes: reading 402 GB to name a
/// trace would defeat the point).
fn fingerprint(files: &ModelFiles) -> String {
    let listing: Vec<u8> = files
        .tensors()
        .iter()
        .flat_map(|t| format!("{}|{}|{:?};", t.name, t.encoding.name(), t.shape).into_bytes())
        .collect();
    format!("{:016x}", fnv1a_bytes(&listing))
}

pub fn run(args: RunArgs) -> anyhow::Result<Outcome> {
    let files = ModelFiles::open(&args.model)?;
    let Some((cfg, family)) = glm5_config(&files)? else {
        bail!(
            "{}: not a GLM-5 checkpoint (no glm-dsa architecture, no glm_moe_dsa or deepseek_v3/v32 config.json)",
            args.model.display()
        );
    };
    crate::shard::plan::check_degree(&cfg, args.tp)?;
    if let Some(fault) = &args.inject {
        fault.check(&cfg, args.tp as usize, args.dtype)?;
    }
    let tokenizer = match &args.prompt {
        Some(_) => Some(tokenize::load(&files)?),
        None => None,
    };
    let tokens = match (&args.prompt, &tokenizer) {
        (Some(text), Some(tok)) => tokenize::encode(tok, text)?,
        _ => args.tokens.clone(),
    };
    if tokens.is_empty() {
        bail!("the prompt is empty");
    }
    let full = if args.full.is_empty() {
        FullSelector::default()
    } else {
        FullSelector::new(&args.full)?
    };
    let header = TraceHeader {
        producer: json!({"name": "glmcheck", "version": env!("CARGO_PKG_VERSION"), "latent_norm_eps": args.latent_norm_eps,
                "inject": args.inject.map(|f| f.spec())})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        model: ModelInfo {
            source: args.model.display().to_string(),
            config: serde_json::to_value(&cfg)?,
            fingerprint: fingerprint(&files),
            extra: Default::default(),
        },
        tokens: tokens.clone(),
        backend: "cpu".into(),
        dtype: args.dtype.name().into(),
        tp: args.tp as u32,
    };
    let mut writer = TraceWriter::create(&args.out, header, full)
        .with_context(|| args.out.display().to_string())?;
    let source = WeightSource::new(files, cfg, family).with_fault(args.inject);
    let opts = ForwardOptions {
        latent_norm_eps: args.latent_norm_eps,
        tp: args.tp as usize,
        ties: None,
    };
    let (n, g) = (&tokens, args.generate);
    let (top1, generated) = match args.dtype {
        Precision::F64 => greedy(&source, n, g, &Cpu::f64(), opts, &mut writer)?,
        p => greedy(&source, n, g, &Cpu::new(p), opts, &mut writer)?,
    };
    writer.finish()?;
    let text = match &tokenizer {
        Some(tok) if !generated.is_empty() => Some(tokenize::decode(tok, &generated)?),
        _ => None,
    };
    if args.json {
        println!(
            "{}",
            json!({"trace": args.out, "tokens": tokens, "top1": top1, "generated": generated, "text": text})
        );
    } else {
        println!(
            "wrote {} ({} positions); top-1 per position: {top1:?}",
            args.out.display(),
            top1.len()
        );
        if !generated.is_empty() {
            println!("generated: {generated:?}");
        }
        if let (Some(prompt), Some(text)) = (&args.prompt, &text) {
            println!("{prompt}{text}");
        }
    }
    Ok(Outcome::Pass)
}

/// The prompt through `be` into `rec`, then `n` greedy tokens: the top-1 token of every prompt
/// position and the generated tokens.
fn greedy<B: Backend>(
    src: &WeightSource,
    prompt: &[u32],
    n: usize,
    be: &B,
    opts: ForwardOptions,
    rec: &mut TraceWriter,
) -> anyhow::Result<(Vec<usize>, Vec<u32>)> {
    let (logits, generated) = generate(src, prompt, n, be, opts, rec)?;
    let top1 = (0..logits.rows)
        .map(|r| topk(logits.row(r), 1)[0])
        .collect();
    Ok((top1, generated))
}
