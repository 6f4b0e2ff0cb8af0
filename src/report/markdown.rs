//! The comparison as GitHub-flavoured Markdown, short enough for a CI job summary: the verdict,
//! the first divergence, the fault with its evidence, the logits in one line, a per-layer table
//! (folded when long) and the stages worth a look.

use std::fmt::Write;

use super::{
    basis_word, growth, headline, is_first, layer_rows, log_level, notable_stages, num,
    partial_note, stage_label, LogitsView,
};
use crate::compare::{DiffReport, Status};

/// Per-layer tables longer than this are folded into a `<details>` block.
const FOLD_ROWS: usize = 16;

/// Text in Markdown prose or a table cell: characters Markdown or HTML would read as markup are
/// escaped, line breaks become spaces.
pub fn text(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' | '<' | '>' => out.push_str(super::escape::entity(c).unwrap_or_default()),
            '\n' | '\r' | '\t' => out.push(' '),
            // Text never starts a line here, so only inline markup (and GitHub's `$` math) counts.
            '\\' | '`' | '*' | '_' | '[' | ']' | '|' | '~' | '$' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() => {}
            c => out.push(c),
        }
    }
    out
}

/// A code span (no markup inside; `|` still escaped so tables keep their cells).
pub fn code(s: &str) -> String {
    let clean: String = s
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .replace('|', "\\|");
    // A fence longer than any run of backticks inside.
    let mut longest = 0;
    let mut run = 0;
    for c in clean.chars() {
        run = if c == '`' { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    let fence = "`".repeat(longest + 1);
    if longest > 0 || clean.starts_with(' ') || clean.ends_with(' ') {
        format!("{fence} {clean} {fence}")
    } else {
        format!("{fence}{clean}{fence}")
    }
}

/// A bar of `width` cells for an error on a log scale from 1e-12 (empty) to 1 (full).
fn bar(rel_diff: f64, width: usize) -> String {
    let filled = (log_level(rel_diff) * width as f64).round() as usize;
    format!("{}{}", "█".repeat(filled), "·".repeat(width - filled))
}

/// The report as Markdown.
pub fn markdown(report: &DiffReport, logits: Option<&LogitsView>) -> String {
    let mut md = String::new();
    let icon = match report.verdict {
        Status::Pass => "✅",
        Status::Fail => "❌",
    };
    let _ = writeln!(md, "### {icon} glmcheck diff: **{}**\n", headline(report));
    if let Some(note) = partial_note(report) {
        let _ = writeln!(md, "**{}**\n", text(&note));
    }
    let _ = writeln!(
        md,
        "{} against {} · candidate dtype {} · tolerance: {} · a tolerance of {} would pass every \
         value stage\n",
        code(&report.candidate),
        code(&report.reference),
        code(&report.candidate_dtype),
        text(&report.tolerance_source),
        code(&num(report.tolerance_to_pass)),
    );
    match &report.first_divergence {
        Some(d) => {
            let mut at = code(&d.stage);
            if let Some(l) = d.layer {
                let _ = write!(at, " (layer {l})");
            }
            if let Some(r) = d.rank {
                let _ = write!(at, " rank {r}");
            }
            let _ = writeln!(md, "**First divergence:** {at}\n");
        }
        None => {
            let _ = writeln!(md, "**First divergence:** none\n");
        }
    }
    if let Some(f) = &report.fault {
        let _ = writeln!(
            md,
            "**Fault:** {} — {}\n",
            code(f.class.name()),
            text(&f.summary)
        );
        if let Some(w) = &f.weight {
            let _ = writeln!(md, "Weight: {}\n", code(w));
        }
        for e in &f.evidence {
            let _ = writeln!(md, "- {}", text(e));
        }
        if !f.evidence.is_empty() {
            md.push('\n');
        }
    }
    if let Some(line) = logits.and_then(logits_line) {
        let _ = writeln!(md, "{line}\n");
    }

    let rows = layer_rows(report);
    if !rows.is_empty() {
        let fold = rows.len() > FOLD_ROWS;
        if fold {
            let _ = writeln!(
                md,
                "<details><summary>Per layer ({} rows; worst stage each)</summary>\n",
                rows.len()
            );
        } else {
            let _ = writeln!(
                md,
                "**Per layer** (worst stage each; bar: rel_diff, log 1e-12…1)\n"
            );
        }
        md.push_str("| layer | worst stage | rel_diff | | min cosine | status |\n");
        md.push_str("|---|---|---:|---|---:|---|\n");
        for row in &rows {
            let status = match (row.failed, row.first) {
                (_, true) => "**FAIL** ◀ first",
                (true, false) => "**FAIL**",
                _ => "ok",
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {status} |",
                text(&row.label()),
                code(&row.worst.stage),
                num(row.worst.rel_diff),
                code(&bar(row.worst.rel_diff, 12)),
                row.min_cosine.map_or("-".into(), |c| format!("{c:.6}")),
            );
        }
        md.push('\n');
        if fold {
            md.push_str("</details>\n\n");
        }
    }

    let notable = notable_stages(report, 5);
    if !notable.is_empty() {
        md.push_str("**Stages around the first divergence and the worst ones**\n\n");
        md.push_str(
            "| stage | basis | status | cosine | rel_diff | tolerance | norm ratio | max \\|Δ\\| \
             | × input |\n",
        );
        md.push_str("|---|---|---|---:|---:|---:|---:|---:|---:|\n");
        for i in notable {
            let s = &report.stages[i];
            let m = s.metrics.as_ref();
            let mark = if is_first(report, s) { "▶ " } else { "" };
            let _ = writeln!(
                md,
                "| {mark}{} | {} | {} | {} | {} | {} | {} | {} | {} |",
                code(&stage_label(s)),
                basis_word(s.basis),
                match s.status {
                    Status::Pass => "ok",
                    Status::Fail => "**FAIL**",
                },
                m.map_or("-".into(), |m| format!("{:.6}", m.cosine)),
                num(s.rel_diff),
                num(s.tolerance),
                m.map_or("-".into(), |m| format!("{:.4}", m.norm_ratio)),
                m.map_or("-".into(), |m| num(m.max_abs)),
                growth(s.amplification),
            );
        }
        md.push('\n');
    }
    md
}

/// One line on the logits: entropy against ln V on each side, KL and top-1 agreement.
fn logits_line(view: &LogitsView) -> Option<String> {
    let mut parts = Vec::new();
    for (name, side) in [
        ("reference", &view.reference),
        ("candidate", &view.candidate),
    ] {
        if let Some(s) = side {
            let h = &s.health;
            let mut p = format!(
                "{name} entropy {:.3} of ln V {:.3}, top-1 p {:.3}",
                h.entropy_mean, h.ln_vocab, h.top1_prob_mean
            );
            if h.flat {
                p.push_str(" (**flat**)");
            }
            if h.nan + h.inf > 0 {
                let _ = write!(p, ", {} NaN, {} Inf", h.nan, h.inf);
            }
            parts.push(p);
        }
    }
    if let Some(c) = &view.comparison {
        parts.push(format!(
            "KL mean {} (max {}), top-1 agreement {:.1} %",
            num(c.kl_mean),
            num(c.kl_max),
            100.0 * c.top1_agreement
        ));
    }
    (!parts.is_empty()).then(|| format!("**Logits:** {}", parts.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_from_traces_is_escaped() {
        assert_eq!(text("<b>a|b</b>"), "&lt;b&gt;a\\|b&lt;/b&gt;");
        assert_eq!(text("x\ny"), "x y");
        assert_eq!(code("L3.out"), "`L3.out`");
        assert_eq!(code("a`b|c"), "`` a`b\\|c ``");
    }

    #[test]
    fn bars_fill_on_a_log_scale() {
        assert_eq!(bar(1.0, 4), "████");
        assert_eq!(bar(1e-6, 4), "██··");
        assert_eq!(bar(0.0, 4), "····");
    }
}
