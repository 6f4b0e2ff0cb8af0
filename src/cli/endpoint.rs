//! `glmcheck endpoint URL MODEL --prompt TEXT`: a running server (vLLM's OpenAI API, or llama.cpp's llama-server)
//! diagnosed from outside: its top-k log-probabilities at every prompt position against the
//! reference forward of the model it serves.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use super::{one_of, Outcome};
use crate::compare::top_k::{KvType, DEFAULT_TOLERANCE};
use crate::dtype::Precision;
use crate::pipeline::endpoint::{check, EndpointSpec, ExplainSpec};
use crate::report::endpoint::{html, markdown, text};

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
    #[arg(long, value_delimiter = ',', required_unless_present_any = ["prompt", "prompts"])]
    pub tokens: Vec<u32>,
    /// Prompts from a file, one per line (blank lines skipped); a line `tokens: 1,5,9` is a
    /// prompt given as token ids.
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,
    /// Log-probabilities asked for at each position (a server that allows fewer, vLLM's
    /// --max-logprobs, 20 by default, is asked again at its cap).
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
    /// The largest |Δ log-probability| (nats) of a listed token that still agrees, with the
    /// reference and, with --concurrency, between a prompt's answers alone and beside others
    /// [default: --kv-type's, else 0.5]
    #[arg(long, value_name = "NATS")]
    pub tolerance: Option<f64>,
    /// The server's KV-cache type, which sets the default --tolerance: f32 0.05, f16 0.1,
    /// q8_0 0.2, bf16 0.5, fp8 and q4_0 1.0 nats.
    #[arg(long, value_parser = one_of(&KvType::ALL, KvType::name))]
    pub kv_type: Option<KvType>,
    /// Ask each prompt again while N requests of glmcheck's own run beside it: a server whose
    /// answer moves beyond the tolerance fails (concurrency_dependence).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=256))]
    pub concurrency: Option<u64>,
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
    /// Also write the report as GitHub-flavoured Markdown (a CI job summary).
    #[arg(long, value_name = "OUT.md")]
    pub markdown: Option<PathBuf>,
    /// Also write the report as one self-contained HTML page (inline CSS and SVG charts, no
    /// scripts, nothing fetched).
    #[arg(long, value_name = "OUT.html")]
    pub html: Option<PathBuf>,
}

pub fn run(args: EndpointArgs) -> anyhow::Result<Outcome> {
    let tolerance = args
        .tolerance
        .unwrap_or(args.kv_type.map_or(DEFAULT_TOLERANCE, KvType::tolerance));
    if !(tolerance > 0.0 && tolerance.is_finite()) {
        anyhow::bail!("--tolerance {tolerance}: a positive number of nats");
    }
    let mut texts = args.prompt.clone();
    let mut token_prompts: Vec<Vec<u32>> = Vec::new();
    if !args.tokens.is_empty() {
        token_prompts.push(args.tokens.clone());
    }
    if let Some(file) = &args.prompts {
        for prompt in read_prompts(file)? {
            match prompt {
                Prompt::Text(t) => texts.push(t),
                Prompt::Tokens(t) => token_prompts.push(t),
            }
        }
    }
    let report = check(&EndpointSpec {
        url: &args.url,
        model: &args.model,
        prompts: &texts,
        token_prompts: &token_prompts,
        top_k: args.top_k,
        max_tokens: args.max_tokens,
        timeout: Duration::from_secs(args.timeout),
        tolerance,
        concurrency: args.concurrency.map(|n| n as usize),
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
    // Written after stdout: a file that cannot be written ends in exit 2 without losing the
    // report of a check that may have taken minutes of the server's and the reference's time.
    if let Some(out) = &args.markdown {
        std::fs::write(out, markdown(&report))
            .with_context(|| format!("{}: writing the Markdown report", out.display()))?;
    }
    if let Some(out) = &args.html {
        std::fs::write(out, html(&report))
            .with_context(|| format!("{}: writing the HTML report", out.display()))?;
    }
    Ok(report.verdict.into())
}

/// One line of a `--prompts` file.
#[derive(Debug, PartialEq)]
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// The prompts of `file`: one per non-blank line, `tokens: 1,5,9` as ids.
fn read_prompts(file: &Path) -> anyhow::Result<Vec<Prompt>> {
    let text =
        std::fs::read_to_string(file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let prompts = parse_prompts(&text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    if prompts.is_empty() {
        anyhow::bail!("{}: no prompt (every line is blank)", file.display());
    }
    Ok(prompts)
}

fn parse_prompts(text: &str) -> Result<Vec<Prompt>, String> {
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match line.strip_prefix("tokens:") {
            Some(ids) => {
                let ids = ids
                    .split(',')
                    .map(|id| id.trim().parse::<u32>())
                    .collect::<Result<Vec<u32>, _>>()
                    .map_err(|e| format!("line {}: token ids: {e}", n + 1))?;
                prompts.push(Prompt::Tokens(ids));
            }
            None => prompts.push(Prompt::Text(line.to_string())),
        }
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompts_file_holds_texts_and_token_lines_and_names_a_bad_line() {
        let p = parse_prompts("The capital of France is\n\n  \ntokens: 1, 5,9\n").unwrap();
        assert_eq!(
            p,
            vec![
                Prompt::Text("The capital of France is".into()),
                Prompt::Tokens(vec![1, 5, 9])
            ]
        );
        let e = parse_prompts("a\ntokens: 1,x\n").unwrap_err();
        assert!(e.starts_with("line 2: token ids:"), "{e}");
    }
}
