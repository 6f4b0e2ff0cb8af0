//! `glmcheck verify REFERENCE CANDIDATE`: every tensor of a checkpoint (a conversion, a
//! quantization) against the checkpoint it was made from, each judged against the error its
//! storage type gives, and any departure named by its relation to the reference.

use std::path::PathBuf;

use anyhow::Context;

use super::Outcome;
use crate::pipeline::Model;
use crate::progress::progress;
use crate::report::verify::{markdown, text};
use crate::verify::{selected, verify, Options};

#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The checkpoint the candidate was made from: a Hugging Face folder or a GGUF (llama.cpp's
    /// F32/F16/BF16 conversion, or another quantization).
    pub reference: PathBuf,
    /// The checkpoint to check: a GGUF of any type (any shard of a split set) or a safetensors
    /// checkpoint.
    pub candidate: PathBuf,
    /// Only candidate tensors whose name matches this glob (repeatable), e.g. `blk.3.*`.
    #[arg(long = "tensor", value_name = "GLOB")]
    pub tensors: Vec<String>,
    /// Demand ggml's bytes: every block must be what glmcheck's (ggml's) quantizer gives the
    /// reference's values — for a file quantized without an importance matrix straight from the
    /// reference's values. Without it, a block within its type's noise passes.
    #[arg(long)]
    pub exact: bool,
    /// Also write the report as Markdown (a CI job summary).
    #[arg(long, value_name = "OUT.md")]
    pub markdown: Option<PathBuf>,
    /// Machine-readable JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: VerifyArgs) -> anyhow::Result<Outcome> {
    let reference = Model::open(&args.reference)?.source();
    let cand = Model::open(&args.candidate)?.source();
    let select = super::dequant::selector(&args.tensors)?;
    let chosen = selected(&cand, select.as_ref());
    if chosen.is_empty() {
        anyhow::bail!(
            "{}: no tensor matches {:?}",
            args.candidate.display(),
            args.tensors
        );
    }
    let total: u64 = chosen.iter().map(|t| t.nbytes).sum();
    let bar = progress(total, args.json, "verifying");
    let tick = |name: &str, n: u64| {
        bar.set_message(name.to_string());
        bar.inc(n);
    };
    let report = verify(
        &reference,
        &cand,
        &Options {
            select: select.as_ref(),
            strict: args.exact,
            progress: &tick,
        },
    )?;
    bar.finish_and_clear();
    if let Some(path) = &args.markdown {
        std::fs::write(path, markdown(&report)).with_context(|| path.display().to_string())?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", text(&report));
    }
    Ok(report.verdict.into())
}
