//! What to bisect and how: the reference, the candidate (glmcheck's own run as set, another
//! checkpoint, or an engine's trace), and the comparison's settings, with the command line's
//! defaults.

use std::path::PathBuf;

use super::WeightCheck;
use crate::any_backend::BackendKind;
use crate::dtype::Precision;
use crate::exec::faults::inject::Injection;
use crate::exec::forward::HF_LATENT_NORM_EPS;

/// How glmcheck runs a candidate it makes itself: vLLM's tensor-parallel split (and expert
/// parallelism) on a backend, in a dtype, with a fault planted or none.
#[derive(Clone, Copy, Debug)]
pub struct RunAs {
    /// Tensor-parallel ranks (vLLM's split, ranks on the CPU or one GPU each).
    pub tp: u64,
    /// Routed experts whole on their owning rank instead of split.
    pub ep: bool,
    pub backend: BackendKind,
    /// bf16/f16 are judged against the reference re-run at that dtype.
    pub dtype: Precision,
    /// A fault from the catalogue ([`crate::exec::faults::inject::CATALOGUE`]).
    pub inject: Option<Injection>,
}

impl Default for RunAs {
    /// TP 1 on the CPU in f32 with nothing planted: the reference's own run.
    fn default() -> Self {
        RunAs {
            tp: 1,
            ep: false,
            backend: BackendKind::Cpu,
            dtype: Precision::F32,
            inject: None,
        }
    }
}

/// What the reference is compared with.
#[derive(Clone, Debug)]
pub enum Candidate {
    /// The reference's own checkpoint, run as set: at a TP degree or dtype, on a backend, with a
    /// planted fault.
    Run(RunAs),
    /// Another checkpoint of the model (a conversion: a GGUF of the reference's HF folder), run
    /// as set, and judged against the reference with every weight stored as it stores them.
    Checkpoint(PathBuf, RunAs),
    /// A trace an engine's probe wrote: its tokens, dtype and TP are the engine's.
    EngineTrace(PathBuf),
}

impl Candidate {
    /// How glmcheck runs it (None: an engine ran it).
    pub fn run_as(&self) -> Option<RunAs> {
        match self {
            Candidate::Run(r) | Candidate::Checkpoint(_, r) => Some(*r),
            Candidate::EngineTrace(_) => None,
        }
    }
}

/// What to bisect and how. [`BisectOptions::new`] gives the defaults the command line has.
#[derive(Clone, Debug)]
pub struct BisectOptions {
    /// The reference checkpoint (a GGUF, any shard of a split set, or a Hugging Face folder).
    pub model: PathBuf,
    pub candidate: Candidate,
    /// Where the reference and its envelope run (TP 1, f32): the CPU, or GPU 0 within f32's
    /// tolerance (1e-8 `rel_diff`) of the CPU's.
    pub reference_backend: BackendKind,
    /// Prompt text through the model's tokenizer; with neither this nor `tokens`,
    /// [`super::DEFAULT_PROMPT`]. An engine's trace brings its own tokens.
    pub prompt: Option<String>,
    pub tokens: Vec<u32>,
    /// Greedy tokens generated after the prompt on both sides, to show what each prints.
    pub generate: usize,
    /// Eps of the q_a/kv_a RMSNorms on both sides (transformers 1e-6; vLLM and llama.cpp use
    /// `rms_norm_eps`).
    pub latent_norm_eps: f64,
    /// An engine's shard manifest, checked at the first divergence for the weights that stage
    /// reads.
    pub actual: Option<PathBuf>,
    /// Keep the traces here; None: a temporary folder, removed after.
    pub out: Option<PathBuf>,
    /// Which of a conversion's weights are checked as `verify` checks them.
    pub weights: WeightCheck,
    pub mode: Mode,
    /// No progress bar.
    pub quiet: bool,
}

impl BisectOptions {
    /// Bisect `model` against its own run at TP 1 in f32 on the CPU, every other option at the
    /// command line's default, without a progress bar.
    pub fn new(model: PathBuf) -> Self {
        BisectOptions {
            model,
            candidate: Candidate::Run(RunAs::default()),
            reference_backend: BackendKind::Cpu,
            prompt: None,
            tokens: Vec::new(),
            generate: 8,
            latent_norm_eps: HF_LATENT_NORM_EPS,
            actual: None,
            out: None,
            weights: WeightCheck::Auto,
            mode: Mode::Stages,
            quiet: true,
        }
    }
}

/// What the candidate is judged by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Every stage both sides record.
    Stages,
    /// The logits alone, as an engine exposing nothing else shows them; the first faulty layer
    /// is found by hybrid runs (the candidate up to a layer, the reference after it).
    Logits,
}

impl Mode {
    pub const ALL: [Mode; 2] = [Mode::Stages, Mode::Logits];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Stages => "stages",
            Mode::Logits => "logits",
        }
    }
}
