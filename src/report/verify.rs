//! `glmcheck verify`'s report for people: terminal tables ([`text`]) and Markdown for a CI job
//! summary ([`markdown()`]), both from one [`VerifyReport`].

use std::fmt::Write as _;

use super::markdown::{code, text as md_text};
use super::num;
use super::terminal::{bytes, table};
use crate::compare::Status as Verdict;
use crate::verify::{Status, VerifyReport};

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

/// The report as terminal tables: per storage type, the tensors that failed or were skipped,
/// the findings with their evidence, and the verdict.
pub fn text(report: &VerifyReport) -> String {
    let mut out = String::new();
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
    let _ = writeln!(out, "{types}");
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
        let _ = writeln!(out, "{t}");
    }
    let s = &report.summary;
    let _ = writeln!(
        out,
        "{} tensors: {} exact (ggml's bytes), {} within their type's noise, {} failed, {} skipped",
        s.tensors, s.exact, s.within_noise, s.failed, s.skipped
    );
    if s.blocks_requantized < s.blocks {
        let _ = writeln!(
            out,
            "re-quantized {} of {} blocks from the reference: a sample and every block whose \
             verdict needed it (--exact: all)",
            s.blocks_requantized, s.blocks
        );
    }
    if report.candidate_imatrix {
        let _ = writeln!(
            out,
            "the candidate was quantized with an importance matrix: its blocks are judged by \
             their type's noise, not by ggml's plain bytes"
        );
    }
    for f in &report.findings {
        let _ = writeln!(
            out,
            "\n{}: {} ({})\n  {}",
            f.tensor,
            f.class.name(),
            f.relation.name(),
            f.summary
        );
        for e in &f.evidence {
            let _ = writeln!(out, "  · {e}");
        }
    }
    match report.verdict {
        Verdict::Pass => {
            let _ = writeln!(
                out,
                "\nverdict: pass — every tensor holds the reference's values"
            );
        }
        Verdict::Fail => {
            let n = report.findings.len();
            let (tensors, their) = if n == 1 {
                ("tensor departs", "its")
            } else {
                ("tensors depart", "their")
            };
            let _ = writeln!(
                out,
                "\nverdict: FAIL — {n} {tensors} from the reference beyond {their} type's noise"
            );
        }
    }
    out
}

/// The report as Markdown for a CI job summary.
pub fn markdown(report: &VerifyReport) -> String {
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
                md_text(&f.summary)
            );
        }
        for f in &report.findings {
            let _ = writeln!(md, "\n**{}**", code(&f.tensor));
            for e in &f.evidence {
                let _ = writeln!(md, "- {}", md_text(e));
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
