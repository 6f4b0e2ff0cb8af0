//! `glmcheck endpoint --markdown OUT --html OUT` against the tiny HTTP server of `mod.rs`:
//! both files written beside `--json`, whose stdout stays the report, for a server that agrees
//! (its model listed under a hostile name, escaped in both files) and for one that answers as
//! the model with `rope-neox` planted (`--explain` names it, both files show where it parts).
//! A file that cannot be written is exit 2 in one line naming it.

use std::path::Path;
use std::sync::Arc;

use serde_json::{json, Value};

use super::{completions, endpoint, logits_of, model_and_logits, serve, vllm_answer, Reply};
use crate::common;

/// A served model's name with HTML and Markdown markup in it.
const HOSTILE: &str = "<script>|*_";

/// `endpoint` with `--json --markdown --html` into `dir`: the exit code, the JSON, both files.
fn reports(
    url: &str,
    model: &Path,
    dir: &Path,
    extra: &[&str],
) -> (Option<i32>, Value, String, String) {
    let (md, html) = (dir.join("endpoint.md"), dir.join("endpoint.html"));
    let mut args = vec![
        "--json",
        "--markdown",
        md.to_str().unwrap(),
        "--html",
        html.to_str().unwrap(),
    ];
    args.extend(extra);
    let out = endpoint(url, model, &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is the JSON report ({e}): {stderr}"));
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    (out.status.code(), report, read(&md), read(&html))
}

/// What no page of glmcheck's holds: a script, or anything fetched or linked from the network.
fn assert_self_contained(html: &str) {
    let lower = html.to_ascii_lowercase();
    assert!(!lower.contains("<script"), "{html}");
    assert!(!lower.contains("href=\"http"), "{html}");
    assert!(!lower.contains("src="), "{html}");
    assert!(!lower.contains("url("), "{html}");
}

#[test]
fn both_files_of_an_agreeing_server_escape_its_hostile_model_name() {
    let dir = common::scratch();
    let (model, logits, vocab) = model_and_logits(dir.path());
    let honest = vllm_answer(&logits, vocab, 4).to_string();
    let models = json!({"object": "list", "data": [{"id": HOSTILE, "object": "model"}]});
    let (url, _) = serve(Arc::new(move |path: &str, _: &Value| match path {
        "/v1/models" => Reply::Answer(200, models.to_string()),
        "/v1/completions" => Reply::Answer(200, honest.clone()),
        _ => Reply::Answer(404, r#"{"error":{"message":"not found"}}"#.into()),
    }));
    let (code, report, md, html) = reports(&url, &model, dir.path(), &[]);
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(report["verdict"], "pass");
    assert_eq!(report["served_model"], HOSTILE);

    assert!(
        md.starts_with("### ✅ glmcheck endpoint: **PASS**\n"),
        "{md}"
    );
    assert!(
        md.contains(&format!(
            "{} (OpenAI API, serving &lt;script&gt;\\|\\*\\_) against the reference",
            url
        )),
        "{md}"
    );
    assert!(
        !md.contains(HOSTILE) && !md.contains("<script"),
        "the model name is escaped: {md}"
    );
    assert!(md.contains("· top-4 log-probabilities"), "{md}");
    assert!(md.contains("| none of 5 positions |"), "{md}");
    assert!(
        md.ends_with("**PASS:** the server agrees with the reference\n"),
        "{md}"
    );

    assert!(html.starts_with("<!DOCTYPE html>"), "{html}");
    assert!(html.contains("<h1>PASS</h1>"), "{html}");
    assert!(
        html.contains("serving <code>&lt;script&gt;|*_</code>"),
        "{html}"
    );
    assert!(!html.contains(HOSTILE), "{html}");
    assert!(html.contains("<svg id=\"prompt-1-chart\""), "{html}");
    assert!(html.contains("none of 5 positions"), "{html}");
    assert_self_contained(&html);
}

#[test]
fn both_files_of_a_failing_server_show_the_parting_and_the_explanation() {
    let dir = common::scratch();
    let (model, _, vocab) = model_and_logits(dir.path());
    let (rope, _) = logits_of(&model, dir.path(), &["--inject", "rope-neox"]);
    let answer = vllm_answer(&rope, vocab, 4).to_string();
    let (url, _) = serve(completions(move |_| Reply::Answer(200, answer.clone())));
    let (code, report, md, html) = reports(&url, &model, dir.path(), &["--explain"]);
    assert_eq!(code, Some(1), "{report:#}");
    assert_eq!(report["verdict"], "fail");
    let part = report["prompts"][0]["comparison"]["first_parting"]["position"]
        .as_u64()
        .unwrap_or_else(|| panic!("the server parts: {report:#}"));
    assert_eq!(report["explanation"]["best"]["name"], "rope-neox");

    assert!(
        md.starts_with("### ❌ glmcheck endpoint: **FAIL**\n"),
        "{md}"
    );
    assert!(
        md.contains(&format!("**First parting:** position {part}: ")),
        "{md}"
    );
    assert!(md.contains(&format!("| position {part} of 5 (")), "{md}");
    assert!(
        md.contains("**Verdict: explained** — rope-neox explains it"),
        "{md}"
    );
    assert!(md.contains("| 1 | `rope-neox` |"), "{md}");
    assert!(md.contains("#### Problems\n\n- prompt 1: "), "{md}");

    assert!(html.contains("<h1>FAIL</h1>"), "{html}");
    assert!(
        html.contains(&format!("prompt 1, position {part}</a>")),
        "{html}"
    );
    assert!(
        html.contains(&format!(">first parting: position {part}</text>")),
        "{html}"
    );
    let best = html.find("<code>rope-neox</code>").expect("the ranking");
    let row = &html[best..best + html[best..].find("</tr>").unwrap()];
    assert!(row.contains("class=\"bar best\""), "{row}");
    assert!(
        html.contains("<h2>explained</h2><p>rope-neox explains it"),
        "{html}"
    );
    assert_self_contained(&html);
}

#[test]
fn a_file_that_cannot_be_written_is_one_line_naming_it() {
    let dir = common::scratch();
    let (model, logits, vocab) = model_and_logits(dir.path());
    let honest = vllm_answer(&logits, vocab, 4).to_string();
    let (url, _) = serve(completions(move |_| Reply::Answer(200, honest.clone())));
    let missing = dir.path().join("no-such-folder").join("endpoint.html");
    let out = endpoint(&url, &model, &["--html", missing.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains(&format!("{}: writing the HTML report", missing.display())),
        "{stderr}"
    );
    // The report on stdout is not lost.
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("PASS: the server agrees with the reference"),
        "{text}"
    );
}
