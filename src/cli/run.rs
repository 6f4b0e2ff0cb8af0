//! `glmcheck run MODEL --tokens IDS --out TRACE`: the CPU reference forward, recorded as a trace.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde_json::json;

use super::inspect::glm5_config;
use super::Outcome;
use crate::cuda::backend::{ProcessRank, RankMemory};
use crate::exec::backend::{Backend, Cpu, Precision};
use crate::exec::engine::{BackendKind, Engine};
use crate::exec::forward::{
    generate, Discard, ForwardOptions, Hybrid, Recorder, Runner, HF_LATENT_NORM_EPS,
};
use crate::exec::inject::Injection;
use crate::exec::ops::topk;
use crate::exec::rendezvous;
use crate::exec::source::WeightSource;
use crate::exec::ties::TieBreaks;
use crate::exec::tokenize;
use crate::model::schema::Family;
use crate::model::Glm5Config;
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
    /// Tensor-parallel ranks, split as vLLM splits GLM-5 (`glmcheck shards`): threads on the
    /// CPU, one GPU each with `--backend cuda`. Per-rank stages are recorded with their rank.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: u64,
    /// Where the ops run: `cpu`, or `cuda` (GPUs 0..TP, cuBLAS GEMMs, NCCL all-reduce; CUDA 13
    /// libraries loaded at run time).
    #[arg(long, value_enum, default_value = "cpu")]
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
    /// read resident, so the recorded pass times the forward without loading (benchmarks).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warm_up: usize,
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

/// One recorded run: where, what and how.
pub struct RunSpec<'a> {
    pub model: &'a Path,
    pub tokens: &'a [u32],
    pub out: &'a Path,
    pub full: FullSelector,
    pub latent_norm_eps: f64,
    pub dtype: Precision,
    pub tp: u64,
    pub ep: bool,
    pub backend: BackendKind,
    /// This process's rank when each rank runs in a process of its own.
    pub process: Option<ProcessRank>,
    pub inject: Option<Injection>,
    pub generate: usize,
    /// Unrecorded forward passes before the recorded one.
    pub warm_up: usize,
    pub ties: Option<&'a TieBreaks>,
    /// Pass every weight through the storage types of this model's files (the quantization
    /// envelope of a conversion to it).
    pub stored_as: Option<&'a Path>,
    /// A hybrid run with a reference model on the CPU at f32, TP 1.
    pub hybrid: Option<Split<'a>>,
}

/// Where a hybrid run hands over between this run and a reference model: blocks (embedding 0,
/// layer `l` at `l + 1`, the head at `L + 1`) below `switch` on one, the rest on the other.
#[derive(Clone, Copy, Debug)]
pub struct Split<'a> {
    pub reference: &'a Path,
    pub switch: usize,
    /// The reference below the switch (replaying the candidate from the reference's inputs),
    /// or above it (the reference finishing what the candidate began).
    pub reference_below: bool,
}

/// What a recorded run printed: the top-1 token of every prompt position and the generated
/// tokens.
pub struct Recorded {
    pub top1: Vec<usize>,
    pub generated: Vec<u32>,
}

/// The model's files and GLM-5 config, or an input error naming the file.
pub fn open_model(model: &Path) -> anyhow::Result<(ModelFiles, Glm5Config, Family)> {
    let files = ModelFiles::open(model)?;
    let Some((cfg, family)) = glm5_config(&files)? else {
        bail!(
            "{}: not a GLM-5 checkpoint (no glm-dsa architecture, no glm_moe_dsa or deepseek_v3/v32 config.json)",
            model.display()
        );
    };
    Ok((files, cfg, family))
}

/// The prompt's token ids (`text` through the model's tokenizer, else `ids`) and the tokenizer.
pub fn prompt_tokens(
    files: &ModelFiles,
    text: Option<&str>,
    ids: &[u32],
) -> anyhow::Result<(Vec<u32>, Option<tokenizers::Tokenizer>)> {
    let (tokens, tokenizer) = match text {
        Some(text) => {
            let tok = tokenize::load(files)?;
            (tokenize::encode(&tok, text)?, Some(tok))
        }
        None => (ids.to_vec(), None),
    };
    if tokens.is_empty() {
        bail!("the prompt is empty");
    }
    Ok((tokens, tokenizer))
}

/// Run `spec` and write its trace.
pub fn record(spec: RunSpec) -> anyhow::Result<Recorded> {
    let (files, cfg, family) = open_model(spec.model)?;
    crate::shard::plan::check_degree(&cfg, spec.tp)?;
    if spec.ep && cfg.n_routed_experts % spec.tp != 0 {
        bail!(
            "--ep: {} routed experts do not split evenly over {} ranks",
            cfg.n_routed_experts,
            spec.tp
        );
    }
    if let Some(fault) = &spec.inject {
        fault.check(&cfg, spec.tp as usize, spec.dtype)?;
    }
    let header = TraceHeader {
        producer: json!({"name": "glmcheck", "version": env!("CARGO_PKG_VERSION"), "latent_norm_eps": spec.latent_norm_eps,
                "inject": spec.inject.map(|f| f.spec()), "ep": spec.ep, "ties_from_reference": spec.ties.map(TieBreaks::count)})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        model: ModelInfo {
            source: spec.model.display().to_string(),
            config: serde_json::to_value(&cfg)?,
            fingerprint: fingerprint(&files),
            extra: Default::default(),
        },
        tokens: spec.tokens.to_vec(),
        backend: spec.backend.name().into(),
        dtype: spec.dtype.name().into(),
        tp: spec.tp as u32,
    };
    if let Some(p) = &spec.process {
        if spec.backend != BackendKind::Cuda || spec.ep || spec.hybrid.is_some() {
            bail!("--rank runs one rank per process with --backend cuda, without --ep");
        }
        if p.world_size as u64 != spec.tp {
            bail!(
                "--world-size {} differs from --tp {}",
                p.world_size,
                spec.tp
            );
        }
    }
    // Every rank process present before any GPU or NCCL wait, which has no deadline of its own.
    let watch = spec
        .process
        .as_ref()
        .map(|p| rendezvous::join(&p.nccl_id, p.rank, p.world_size, p.timeout))
        .transpose()?;
    // The GPUs first: without them no trace folder is left behind.
    let engine = match spec.dtype {
        Precision::F64 => None,
        p => Some(Engine::open(
            spec.backend,
            p,
            spec.tp as usize,
            spec.process.as_ref(),
        )?),
    };
    // With a process per rank, rank 0 writes the trace; the others compute their shards.
    let mut writer = match &spec.process {
        Some(p) if p.rank != 0 => None,
        _ => Some(
            TraceWriter::create(spec.out, header, spec.full)
                .with_context(|| spec.out.display().to_string())?,
        ),
    };
    let rec: &mut dyn Recorder = match &mut writer {
        Some(w) => w,
        None => &mut Discard,
    };
    let mut source = WeightSource::new(files, cfg, family).with_fault(spec.inject);
    if let Some(other) = spec.stored_as {
        let (files, cfg, family) = open_model(other)?;
        source = source.stored_as(&WeightSource::new(files, cfg, family));
    }
    let opts = ForwardOptions {
        latent_norm_eps: spec.latent_norm_eps,
        tp: spec.tp as usize,
        ep: spec.ep,
        ties: spec.ties,
    };
    let (n, g) = (spec.tokens, spec.generate);
    let recorded = match (spec.dtype, spec.hybrid) {
        (Precision::F64, None) if spec.backend == BackendKind::Cpu => {
            let be = Cpu::f64();
            let run = Runner {
                src: &source,
                be: &be,
                opts,
            };
            greedy(&Hybrid::single(run), n, g, rec)?
        }
        (Precision::F64, _) => bail!("f64 runs only on the CPU and not as a hybrid"),
        (_, hybrid) => {
            let Some(be) = engine else {
                bail!("f64 runs only on the CPU");
            };
            let candidate = Runner {
                src: &source,
                be: &be,
                opts,
            };
            let recorded = match hybrid {
                None => {
                    let run = Hybrid::single(candidate);
                    for _ in 0..spec.warm_up {
                        greedy(&run, n, 0, &mut Discard)?;
                    }
                    greedy(&run, n, g, rec)?
                }
                Some(split) => {
                    let (files, cfg, family) = open_model(split.reference)?;
                    let reference = WeightSource::new(files, cfg, family);
                    let f32_be = Engine::Cpu(Cpu::new(Precision::F32));
                    let reference = Runner {
                        src: &reference,
                        be: &f32_be,
                        opts: ForwardOptions {
                            tp: 1,
                            ep: false,
                            ties: None,
                            ..opts
                        },
                    };
                    let (below, above) = if split.reference_below {
                        (reference, candidate)
                    } else {
                        (candidate, reference)
                    };
                    let run = Hybrid {
                        below,
                        above,
                        switch: split.switch,
                    };
                    greedy(&run, n, g, rec)?
                }
            };
            let memory = be.gpu_memory();
            if let (Some(w), false) = (&mut writer, memory.is_empty()) {
                let per_rank = |f: fn(&RankMemory) -> serde_json::Value| -> serde_json::Value {
                    memory.iter().map(f).collect()
                };
                w.set_producer("gpu_peak_bytes", per_rank(|m| json!(m.peak_bytes)));
                w.set_producer("gpu_resident_bytes", per_rank(|m| json!(m.resident_bytes)));
                w.set_producer("gpu_loaded_bytes", per_rank(|m| json!(m.loaded_bytes)));
                w.set_producer("gpu_load_seconds", per_rank(|m| json!(m.load_seconds)));
                if let Some(p) = &spec.process {
                    w.set_producer("processes", json!(p.world_size));
                }
            }
            recorded
        }
    };
    if let Some(w) = writer {
        w.finish()?;
    }
    if let Some(w) = watch {
        w.finish()?;
    }
    Ok(recorded)
}

pub fn run(args: RunArgs) -> anyhow::Result<Outcome> {
    let (files, _, _) = open_model(&args.model)?;
    let (tokens, tokenizer) = prompt_tokens(&files, args.prompt.as_deref(), &args.tokens)?;
    drop(files);
    let full = if args.full.is_empty() {
        FullSelector::default()
    } else {
        FullSelector::new(&args.full)?
    };
    let Recorded { top1, generated } = record(RunSpec {
        model: &args.model,
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
    run: &Hybrid<'_, B>,
    prompt: &[u32],
    n: usize,
    rec: &mut dyn Recorder,
) -> anyhow::Result<Recorded> {
    let (logits, generated) = generate(run, prompt, n, rec)?;
    let top1 = (0..logits.rows)
        .map(|r| topk(logits.row(r), 1)[0])
        .collect();
    Ok(Recorded { top1, generated })
}
