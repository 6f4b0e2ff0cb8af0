//! The gate's verdict as JUnit XML, which CI systems show as test results: one testsuite per
//! baseline, one testcase per stage record (and one for the per-position logits), a `<failure>`
//! with the statistics, baseline and candidate values and limits of every broken check.

use std::fmt::Write;

use crate::compare::Status;
use crate::gate::check::GateReport;
use crate::report::escape::markup as escape;

/// A float as the failure text shows it: all the digits that tell it apart.
fn value(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v}"))
}

/// The report as a JUnit XML document; `suite` names the testsuite (the baseline file).
pub fn junit(report: &GateReport, suite: &str) -> String {
    let mut x = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let (tests, failures) = (report.stages.len(), report.failed);
    let _ = writeln!(
        x,
        "<testsuites name=\"glmcheck gate\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\">"
    );
    let _ = writeln!(
        x,
        "  <testsuite name=\"{}\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\" skipped=\"0\">",
        escape(suite)
    );
    x.push_str("    <properties>\n");
    for (name, v) in [
        ("baseline", report.baseline.clone()),
        ("candidate", report.candidate.clone()),
        ("dtype", report.dtype.clone()),
        ("tp", report.tp.to_string()),
        ("epsilon", format!("{:e}", report.epsilon)),
    ] {
        let _ = writeln!(
            x,
            "      <property name=\"{name}\" value=\"{}\"/>",
            escape(&v)
        );
    }
    x.push_str("    </properties>\n");
    let class = format!("glmcheck.gate.{suite}");
    for s in &report.stages {
        let open = format!(
            "    <testcase classname=\"{}\" name=\"{}\"",
            escape(&class),
            escape(&s.label())
        );
        if s.status == Status::Pass {
            let _ = writeln!(x, "{open}/>");
            continue;
        }
        let _ = writeln!(x, "{open}>");
        let summary: Vec<String> = s
            .failures
            .iter()
            .map(|f| format!("{}: {}", f.check, f.why))
            .collect();
        let _ = write!(
            x,
            "      <failure type=\"regression\" message=\"{}: {}\">",
            escape(&s.label()),
            escape(&summary.join("; "))
        );
        for f in &s.failures {
            let line = format!(
                "{}: baseline {} candidate {} limit {}: {}\n",
                f.check,
                value(f.baseline),
                value(f.candidate),
                value(f.limit),
                f.why
            );
            x.push_str(&escape(&line).replace("&#10;", "\n"));
        }
        x.push_str("</failure>\n    </testcase>\n");
    }
    if !report.notes.is_empty() {
        let notes = report.notes.join("\n");
        let _ = writeln!(
            x,
            "    <system-out>{}</system-out>",
            escape(&notes).replace("&#10;", "\n")
        );
    }
    x.push_str("  </testsuite>\n</testsuites>\n");
    x
}
