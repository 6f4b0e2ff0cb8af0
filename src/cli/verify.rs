//! `glmcheck verify REFERENCE CANDIDATE`: every tensor of a checkpoint (a conversion, a
//! quantization) against the checkpoint it was made from, each judged against the error its
//! storage type gives, and any departure named by its relation to the reference.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context;

use super::Outcome;
use crate::compare::Status as Verdict;
use crate::pipeline::Model;
use crate::progress::progress;
use crate::report::markdown::{code, text};
use crate::report::num;
use crate::report::terminal::{bytes, table};
use crate::verify::{selected, verify, Options, Status, VerifyReport};

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
        print_text(&report);
    }
    Ok(match report.verdict {
        Verdict::Pass => Outcome::Pass,
        Verdict::Fail => Outcome::Fail,
    })
}

fn status_word(s: Status) -> &'static str {
    match s {
        Status::Exact => "exact",
        Status::Noise => "within noise",
        Status::Fail => "FAIL",
        Status::Skipped => "skipped",
    }
}

/// Per storage type: tensors, bytes, and how many were exact, within noise, failed, skipped.
fn by_type(report: &VerifyReport) -> Vec<(String, [usize; 4], u64)> {
    let mut rows: Vec<(String, [usize; 4], u64)> = Vec::new();
    for t in &report.tensors {
        let i = match rows.iter().position(|r| r.0 == t.ty) {
            Some(i) => i,
            None => {
                rows.push((t.ty.clone(), [0; 4], 0));
                rows.len() - 1
            }
        };
        let k = match t.status {
            Status::Exact => 0,
            Status::Noise => 1,
            Status::Fail => 2,
            Status::Skipped => 3,
        };
        rows[i].1[k] += 1;
        rows[i].2 += t.bytes;
    }
    rows
}

fn print_text(report: &VerifyReport) {
    let mut types = table(&[
        "type",
        "tensors",
        "bytes",
        "exact",
        "within noise",
        "failed",
        "skipped",
    ]);
    for (ty, n, b) in by_type(report) {
        types.add_row(vec![
            ty,
            n.iter().sum::<usize>().to_string(),
            bytes(b),
            n[0].to_string(),
            n[1].to_string(),
            n[2].to_string(),
            n[3].to_string(),
        ]);
    }
    println!("{types}");
    let notable: Vec<_> = report
        .tensors
        .iter()
        .filter(|t| matches!(t.status, Status::Fail | Status::Skipped))
        .collect();
    if !notable.is_empty() {
        let mut t = table(&[
            "tensor",
            "type",
            "status",
            "rel_diff",
            "noise",
            "segments past the band",
        ]);
        for c in notable {
            t.add_row(vec![
                c.tensor.clone(),
                c.ty.clone(),
                status_word(c.status).to_string(),
                num(c.rel_diff),
                num(c.noise),
                match &c.why {
                    Some(why) => why.clone(),
                    None => c.blocks_beyond.to_string(),
                },
            ]);
        }
        println!("{t}");
    }
    let s = &report.summary;
    println!(
        "{} tensors: {} exact (ggml's bytes), {} within their type's noise, {} failed, {} skipped",
        s.tensors, s.exact, s.within_noise, s.failed, s.skipped
    );
    if s.blocks_requantized < s.blocks {
        println!(
            "re-quantized {} of {} blocks from the reference: a sample and every block whose \
             verdict needed it (--exact: all)",
            s.blocks_requantized, s.blocks
        );
    }
    if report.candidate_imatrix {
        println!(
            "the candidate was quantized with an importance matrix: its blocks are judged by \
             their type's noise, not by ggml's plain bytes"
        );
    }
    for f in &report.findings {
        println!(
            "\n{}: {} ({})\n  {}",
            f.tensor,
            f.class.name(),
            f.relation.name(),
            f.summary
        );
        for e in &f.evidence {
            println!("  · {e}");
        }
    }
    match report.verdict {
        Verdict::Pass => println!("\nverdict: pass — every tensor holds the reference's values"),
        Verdict::Fail => {
            let n = report.findings.len();
            let (tensors, their) = if n == 1 {
                ("tensor departs", "its")
            } else {
                ("tensors depart", "their")
            };
            println!(
                "\nverdict: FAIL — {n} {tensors} from the reference beyond {their} type's noise"
            )
        }
    }
}

/// The report as Markdown for a CI job summary.
fn markdown(report: &VerifyReport) -> String {
    let mut md = String::new();
    let (icon, word) = match report.verdict {
        Verdict::Pass => ("✅", "pass"),
        Verdict::Fail => ("❌", "fail"),
    };
    let s = &report.summary;
    let _ = writeln!(md, "### {icon} glmcheck verify: **{word}**\n");
    let _ = writeln!(
        md,
        "{} against {} · {} tensors: {} exact, {} within noise, {} failed, {} skipped\n",
        code(&report.candidate),
        code(&report.reference),
        s.tensors,
        s.exact,
        s.within_noise,
        s.failed,
        s.skipped
    );
    if !report.findings.is_empty() {
        let _ = writeln!(
            md,
            "| tensor | class | relation | summary |\n|---|---|---|---|"
        );
        for f in &report.findings {
            let _ = writeln!(
                md,
                "| {} | `{}` | `{}` | {} |",
                code(&f.tensor),
                f.class.name(),
                f.relation.name(),
                text(&f.summary)
            );
        }
        for f in &report.findings {
            let _ = writeln!(md, "\n**{}**", code(&f.tensor));
            for e in &f.evidence {
                let _ = writeln!(md, "- {}", text(e));
            }
        }
        md.push('\n');
    }
    let _ = writeln!(
        md,
        "| type | tensors | exact | within noise | failed | skipped |\n|---|---|---|---|---|---|"
    );
    for (ty, n, _) in by_type(report) {
        let _ = writeln!(
            md,
            "| {ty} | {} | {} | {} | {} | {} |",
            n.iter().sum::<usize>(),
            n[0],
            n[1],
            n[2],
            n[3]
        );
    }
    md
}
