//! The `glmcheck` command line: one module per command; this one holds the argument types.

mod bisect;
mod demo;
mod dequant;
mod diff;
mod endpoint;
mod gate;
mod inspect;
mod logits;
mod run;
mod selftest;
mod shards;
mod synth;
mod verify;

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Parser, Subcommand};

use crate::compare::Status;

/// How a command ended: the process exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0: every check passed.
    Pass = 0,
    /// Exit 1: a check failed or a divergence was found.
    Fail = 1,
    /// Exit 2, as for any input that cannot be judged: a partial trace (a run that did not
    /// finish) whose stages showed nothing wrong. Never a pass, and not a divergence either.
    Incomplete = 2,
}

impl Outcome {
    /// The outcome of a verdict over traces of which some may be partial: a failed stage is a
    /// failure whatever is missing; otherwise a partial input cannot pass.
    pub fn of(stage_failed: bool, partial: bool) -> Outcome {
        match (stage_failed, partial) {
            (true, _) => Outcome::Fail,
            (false, true) => Outcome::Incomplete,
            (false, false) => Outcome::Pass,
        }
    }
}

impl From<Status> for Outcome {
    /// A report's verdict: a pass or a failed check.
    fn from(verdict: Status) -> Outcome {
        match verdict {
            Status::Pass => Outcome::Pass,
            Status::Fail => Outcome::Fail,
        }
    }
}

/// Find why a large language model prints garbage.
///
/// Exit codes: 0 pass, 1 a check failed or a divergence was found, 2 usage or input error.
#[derive(Parser, Debug)]
#[command(name = "glmcheck", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// A tiny GLM-5 GGUF (`--family`: another member) in a temporary folder: inspect, dequant,
    /// then bisect a TP=4 candidate with kv_b_proj loaded unsharded (the diagnosis, its
    /// evidence, both sides' text).
    Demo(demo::DemoArgs),
    /// Format, metadata, the family member and how it differs from GLM-5, config, tensor table,
    /// schema check, quant histogram, bytes per TP rank.
    Inspect(inspect::InspectArgs),
    /// Dequantize weights to f32 and check their health (NaN/Inf, fp16/bf16 range, outliers);
    /// with `--device cuda`, every tensor's GPU dequantization against the CPU's.
    Dequant(dequant::DequantArgs),
    /// Run the reference forward on a prompt (CPU, or `--backend cuda` on GPUs) and record every
    /// stage as a trace.
    Run(run::RunArgs),
    /// The one-shot diagnosis: run the reference and a candidate (TP, dtype, a planted fault,
    /// another MODEL or an engine's TRACE), compare, drill down, name the faulty step.
    Bisect(bisect::BisectArgs),
    /// Compare two traces: metrics per stage, the first divergence, the fault class.
    Diff(diff::DiffArgs),
    /// CI gate: a candidate (trace, or a model run here) against a reviewed baseline's per-stage
    /// statistics and per-position logits; exit 1 on a regression, JUnit XML and Markdown
    /// summaries; `--update` writes the baseline from the candidate.
    Gate(gate::GateArgs),
    /// Logits health (entropy, flatness, repeats, NaN); against a reference KL, top-1, Δp.
    Logits(logits::LogitsArgs),
    /// A running OpenAI-compatible server (vLLM) diagnosed from outside: its top-k
    /// log-probabilities at every prompt position against the reference forward of the model it
    /// serves (KL, top-1, Δp, the first position where they part).
    Endpoint(endpoint::EndpointArgs),
    /// vLLM's tensor-parallel plan per weight and rank, and the bytes each rank holds; with
    /// `--actual`, an engine's shard manifest checked against it.
    Shards(shards::ShardsArgs),
    /// Every tensor of a checkpoint (a conversion, a quantization) against the checkpoint it was
    /// made from: bit-exact where glmcheck reproduces ggml's quantizer, else against the noise its
    /// storage type gives; a departure is named by its relation (a scalar multiple, experts,
    /// heads or rows in another order, a transpose, zeros, NaN, another tensor's bytes, garbage).
    Verify(verify::VerifyArgs),
    /// Write a synthetic model of the family (GLM-5, or `--family` DeepSeek-V2/V3/V3.2, Kimi-K2,
    /// GLM-4.7-Flash; GGUF or Hugging Face), deterministic from a seed.
    Synth(synth::SynthArgs),
    /// Every backend op (GEMM, an expert's whole MLP, norms, SiLU, add, rounding, RoPE, MLA
    /// attention, the DSA indexer's scores, all-reduce) on random inputs against f64 on the CPU:
    /// a table of NMSE per op and dtype with limits; `--backend cuda` on GPUs.
    Selftest(selftest::SelftestArgs),
}

/// The model argument shared by the commands that read weights.
#[derive(clap::Args, Debug)]
pub struct ModelArg {
    /// A `.gguf` file (any shard of a split set), a `.safetensors` file, an index JSON, or a
    /// Hugging Face folder (`config.json` + `*.safetensors`).
    pub model: PathBuf,
    /// Machine-readable JSON on stdout instead of tables.
    #[arg(long)]
    pub json: bool,
}

pub fn run(cli: Cli) -> anyhow::Result<Outcome> {
    match cli.command {
        Command::Demo(a) => demo::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Dequant(a) => dequant::run(a),
        Command::Synth(a) => synth::run(a),
        Command::Run(a) => run::run(a),
        Command::Diff(a) => diff::run(a),
        Command::Bisect(a) => bisect::run(a),
        Command::Gate(a) => gate::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Endpoint(a) => endpoint::run(a),
        Command::Shards(a) => shards::run(a),
        Command::Selftest(a) => selftest::run(a),
        Command::Verify(a) => verify::run(a),
    }
}

/// A value parser for one of a library enum's values by name (`all` and its `name`), so that
/// the library's types need no clap of their own.
fn one_of<T: Copy + Send + Sync + 'static>(
    all: &'static [T],
    name: fn(T) -> &'static str,
) -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(all.iter().map(|&v| name(v))).map(move |s| {
        *all.iter()
            .find(|&&v| name(v) == s)
            .expect("clap admits only the names given")
    })
}
