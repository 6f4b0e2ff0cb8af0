//! A recorded run: a model's forward on a backend, at a dtype and TP degree, with a planted
//! fault or near-tie choices or as a hybrid with a reference, written as a trace.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::bail;
use serde_json::json;

use super::Model;
use crate::any_backend::{AnyBackend, BackendKind};
use crate::cuda::memory::RankMemory;
use crate::cuda::ranks::ProcessRank;
use crate::dtype::Precision;
use crate::exec::backend::{Backend, Cpu};
use crate::exec::faults::inject::Injection;
use crate::exec::forward::recorder::{Discard, Recorder, Rehearsal};
use crate::exec::forward::timed::{Timed, TimedRecorder};
use crate::exec::forward::{generate, ForwardOptions, Hybrid, Runner};
use crate::exec::ops::argmax;
use crate::exec::ops::op_clock::{OpClock, OpTime};
use crate::exec::ops::ties::TieBreaks;
use crate::exec::source::WeightSource;
use crate::model::tokenize;
use crate::pipeline::rendezvous;
use crate::trace::{stats::fnv1a_bytes, FullSelector, ModelInfo, TraceHeader, TraceWriter};
use crate::weights::ModelFiles;
use rayon::prelude::*;

/// A digest of the weights' names, types and shapes (not their bytes: reading 402 GB to name a
/// trace would defeat the point).
pub(crate) fn fingerprint(files: &ModelFiles) -> String {
    let listing: Vec<u8> = files
        .tensors()
        .iter()
        .flat_map(|t| format!("{}|{}|{:?};", t.name, t.encoding.name(), t.shape).into_bytes())
        .collect();
    format!("{:016x}", fnv1a_bytes(&listing))
}

/// One recorded run: where, what and how.
pub struct RunSpec<'a> {
    pub model: &'a Model,
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
    pub stored_as: Option<&'a Model>,
    /// A hybrid run with a reference model at f32, TP 1.
    pub hybrid: Option<Split<'a>>,
}

/// Where a hybrid run hands over between this run and a reference model: blocks (embedding 0,
/// layer `l` at `l + 1`, the head at `L + 1`) below `switch` on one, the rest on the other.
#[derive(Clone, Copy)]
pub struct Split<'a> {
    pub reference: &'a Model,
    /// Where the reference's blocks run (on the GPU: GPU 0).
    pub reference_backend: BackendKind,
    pub switch: usize,
    /// The reference below the switch (replaying the candidate from the reference's inputs),
    /// or above it (the reference finishing what the candidate began).
    pub reference_below: bool,
}

/// What a recorded run printed: the top-1 token of every prompt position and the generated
/// tokens; and where its recorded pass (the prompt and the generated tokens, not the warm-up
/// passes) spent its time.
pub struct Recorded {
    pub top1: Vec<usize>,
    pub generated: Vec<u32>,
    /// The backend's ops and the stages' recording, the costliest first (thread-seconds).
    pub op_times: Vec<OpTime>,
    /// The recorded pass's wall time.
    pub pass_seconds: f64,
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
    let (files, cfg) = (&spec.model.files, &spec.model.cfg);
    crate::shard::plan::check_degree(cfg, spec.tp)?;
    if spec.ep && cfg.n_routed_experts % spec.tp != 0 {
        bail!(
            "--ep: {} routed experts do not split evenly over {} ranks",
            cfg.n_routed_experts,
            spec.tp
        );
    }
    if let Some(fault) = &spec.inject {
        fault.check(cfg, spec.tp as usize, spec.dtype)?;
    }
    let header = TraceHeader {
        producer: json!({"name": "glmcheck", "version": env!("CARGO_PKG_VERSION"), "latent_norm_eps": spec.latent_norm_eps,
                "inject": spec.inject.map(|f| f.spec()), "ep": spec.ep, "ties_from_reference": spec.ties.map(TieBreaks::count)})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        model: ModelInfo {
            source: spec.model.path().display().to_string(),
            config: serde_json::to_value(cfg)?,
            fingerprint: fingerprint(files),
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
        p => Some(AnyBackend::open(
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
            // Its errors name the trace's folder.
            TraceWriter::create(spec.out, header, spec.full)?,
        ),
    };
    let clock = Arc::new(OpClock::default());
    let mut discard = Discard;
    let mut rec = TimedRecorder {
        inner: match &mut writer {
            Some(w) => w,
            None => &mut discard,
        },
        clock: &clock,
    };
    let rec: &mut dyn Recorder = &mut rec;
    let mut source = spec.model.source().with_fault(spec.inject);
    if let Some(other) = spec.stored_as {
        source = source.stored_as(&other.source());
    }
    // Generated tokens and warm-up passes run every weight again: hold each once.
    let later_passes = spec.generate > 0 || spec.warm_up > 0;
    if let (Some(engine), true) = (&engine, later_passes) {
        // A rank's blocks first: they spare a read from disk, a kept weight only a dequantization.
        let stored: u64 = source.files.tensors().iter().map(|t| t.nbytes).sum();
        engine.set_aside_for_blocks(stored.div_ceil(spec.tp.max(1)));
    }
    let keeping = |s: WeightSource| if later_passes { s.keeping_weights() } else { s };
    let source = keeping(source);
    let opts = ForwardOptions {
        latent_norm_eps: spec.latent_norm_eps,
        tp: spec.tp as usize,
        ep: spec.ep,
        ties: spec.ties,
    };
    let (n, g) = (spec.tokens, spec.generate);
    let mut began = Instant::now();
    let top1_generated = match (spec.dtype, spec.hybrid) {
        (Precision::F64, None) if spec.backend == BackendKind::Cpu => {
            let be = Timed::new(Cpu::f64(), clock.clone());
            let run = Runner {
                src: &source,
                be: &be,
                opts,
            };
            greedy(&Hybrid::single(run), n, g, rec)?
        }
        (Precision::F64, _) => bail!("f64 runs only on the CPU and not as a hybrid"),
        (_, hybrid) => {
            let Some(engine) = engine else {
                bail!("f64 runs only on the CPU");
            };
            let be = Timed::new(engine.clone(), clock.clone());
            let candidate = Runner {
                src: &source,
                be: &be,
                opts,
            };
            let recorded = match hybrid {
                None => {
                    let run = Hybrid::single(candidate);
                    for _ in 0..spec.warm_up {
                        let mut rehearsal = Rehearsal::like(rec);
                        greedy(&run, n, 0, &mut rehearsal)?;
                        rehearsal.finish()?;
                    }
                    clock.reset();
                    began = Instant::now();
                    greedy(&run, n, g, rec)?
                }
                Some(split) => {
                    let reference = keeping(split.reference.source());
                    // On the candidate's GPUs when both run there: one memory budget for both.
                    let f32_engine = match (&engine, split.reference_backend) {
                        (AnyBackend::Cuda(gpus), BackendKind::Cuda) => {
                            AnyBackend::Cuda(gpus.at_precision(Precision::F32))
                        }
                        (_, kind) => AnyBackend::open(kind, Precision::F32, 1, None)?,
                    };
                    let f32_be = Timed::new(f32_engine, clock.clone());
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
            let memory = engine.gpu_memory();
            if let (Some(w), false) = (&mut writer, memory.is_empty()) {
                let per_rank = |f: fn(&RankMemory) -> serde_json::Value| -> serde_json::Value {
                    memory.iter().map(f).collect()
                };
                w.set_producer("gpu_peak_bytes", per_rank(|m| json!(m.peak_bytes)));
                w.set_producer("gpu_resident_bytes", per_rank(|m| json!(m.resident_bytes)));
                w.set_producer(
                    "gpu_kept_weight_bytes",
                    per_rank(|m| json!(m.kept_weight_bytes)),
                );
                w.set_producer("gpu_loaded_bytes", per_rank(|m| json!(m.loaded_bytes)));
                w.set_producer("gpu_load_seconds", per_rank(|m| json!(m.load_seconds)));
                if let Some(p) = &spec.process {
                    w.set_producer("processes", json!(p.world_size));
                }
            }
            recorded
        }
    };
    let pass_seconds = began.elapsed().as_secs_f64();
    if let Some(w) = &mut writer {
        w.set_producer("op_seconds", clock.to_json());
        w.set_producer("pass_seconds", json!(pass_seconds));
    }
    if let Some(w) = writer {
        w.finish()?;
    }
    if let Some(w) = watch {
        w.finish()?;
    }
    let (top1, generated) = top1_generated;
    Ok(Recorded {
        top1,
        generated,
        op_times: clock.times(),
        pass_seconds,
    })
}

/// The prompt through `be` into `rec`, then `n` greedy tokens: the top-1 token of every prompt
/// position and the generated tokens.
fn greedy<B: Backend>(
    run: &Hybrid<'_, B>,
    prompt: &[u32],
    n: usize,
    rec: &mut dyn Recorder,
) -> anyhow::Result<(Vec<usize>, Vec<u32>)> {
    let (logits, generated) = generate(run, prompt, n, rec)?;
    let top1 = (0..logits.rows)
        .into_par_iter()
        .map(|r| argmax(logits.row(r)).unwrap_or(0))
        .collect();
    Ok((top1, generated))
}
