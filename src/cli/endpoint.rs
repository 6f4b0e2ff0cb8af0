//! `glmcheck endpoint URL MODEL --prompt TEXT`: a running OpenAI-compatible server (vLLM)
//! diagnosed from outside: its top-k log-probabilities at every prompt position against the
//! reference forward of the model it serves.

use std::path::PathBuf;
use std::time::Duration;

use super::{one_of, Outcome};
use crate::compare::top_k::DEFAULT_TOLERANCE;
use crate::dtype::Precision;
use crate::pipeline::endpoint::{check, EndpointSpec, ExplainSpec};
use crate::report::endpoint::text;

#[derive(clap::Args, Debug)]
pub struct EndpointArgs {
    /// The server's base URL, plain HTTP (`http://host:8000`, with or without `/v1`).
    pub url: String,
    /// The GGUF or Hugging Face folder the server serves, here on disk: its tokenizer makes the
    /// prompt's ids, glmcheck's CPU reference runs it.
    pub model: PathBuf,
    /// A prompt's text, tokenized with the model's tokenizer (repeatable: one request each).
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A prompt as token ids, comma-separated (`--tokens 1,5,9`).
    #[arg(long, value_delimiter = ',', required_unless_present = "prompt")]
    pub tokens: Vec<u32>,
    /// Log-probabilities asked for at each position (vLLM's `--max-logprobs`, 20 by default,
    /// caps it).
    #[arg(long, default_value_t = 20)]
    pub top_k: u32,
    /// Greedy tokens generated after each prompt (its continuation is compared, and checked
    /// for one token repeated).
    #[arg(long, default_value_t = 8)]
    pub max_tokens: u32,
    /// The longest the exchange with the server may take, in seconds, every call and retry
    /// included.
    #[arg(long, value_name = "SECS", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// The largest |Δ log-probability| (nats) of a listed token that still agrees.
    #[arg(long, value_name = "NATS", default_value_t = DEFAULT_TOLERANCE)]
    pub tolerance: f64,
    /// Where the server parts from the reference, which catalogued fault explains it best:
    /// each planted in turn in the reference (and none: the clean model), scored by how well it
    /// reproduces the server's log-probabilities.
    #[arg(long)]
    pub explain: bool,
    /// `--explain`: the most runs, the clean model's included (default: every fault that can
    /// exist at the server's TP and dtype).
    #[arg(long, value_name = "N", requires = "explain")]
    pub budget: Option<u64>,
    /// `--explain`: the server's tensor-parallel degree (vLLM's `--tensor-parallel-size`);
    /// faults that exist only with TP are tried at 2 or more.
    #[arg(long, requires = "explain", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub tp: Option<u64>,
    /// `--explain`: the precision the hypotheses run at (f32, or bf16/f16 emulating the GPU).
    #[arg(long, default_value = "f32", requires = "explain",
          value_parser = one_of(&Precision::ALL, Precision::name))]
    pub dtype: Precision,
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: EndpointArgs) -> anyhow::Result<Outcome> {
    if !(args.tolerance > 0.0 && args.tolerance.is_finite()) {
        anyhow::bail!("--tolerance {}: a positive number of nats", args.tolerance);
    }
    let report = check(&EndpointSpec {
        url: &args.url,
        model: &args.model,
        prompts: &args.prompt,
        tokens: &args.tokens,
        top_k: args.top_k,
        max_tokens: args.max_tokens,
        timeout: Duration::from_secs(args.timeout),
        tolerance: args.tolerance,
        explain: args.explain.then_some(ExplainSpec {
            tp: args.tp,
            dtype: args.dtype,
            budget: args.budget.map(|b| b as usize),
            quiet: args.json,
        }),
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }
    Ok(report.verdict.into())
}
