//! Helpers shared by the integration tests: the Python oracle interpreter and scratch folders.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// Repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The Python interpreter that has the oracles (`gguf`, `numpy`, `torch`, `transformers`):
/// `$GLMCHECK_PYTHON`, else the project's `.venv` made by `scripts/setup-venv`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("GLMCHECK_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = root().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "no Python oracle: run scripts/setup-venv or set GLMCHECK_PYTHON"
    );
    venv
}

/// The interpreter of a vLLM venv: `$VAR`, else `venv/bin/python` made by `scripts/setup-vllm
/// RELEASE`; missing, the test fails saying so.
pub fn vllm_python(var: &str, venv: &str, release: &str) -> PathBuf {
    let python = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(venv).join("bin/python"));
    assert!(
        python.exists(),
        "{}: no vLLM {release} interpreter; run scripts/setup-vllm {release} or set {var}",
        python.display()
    );
    python
}

/// `PYTHON -m glmcheck_oracle.MODULE`: one of the oracles of `tests/oracle/` (the package
/// `glmcheck_oracle`, which scripts/setup-venv and scripts/setup-vllm install), `MODULE` as
/// `hf.logits` or `vllm23.run_ranks`, run by the interpreter `python`; the caller adds arguments.
pub fn oracle_command(python: &Path, module: &str) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg("-m").arg(format!("glmcheck_oracle.{module}"));
    cmd
}

/// Run the oracle `glmcheck_oracle.MODULE` (see [`oracle_command`]) with arguments in the
/// oracle interpreter; its stdout. Panics with its stderr on failure.
pub fn run_oracle(module: &str, args: &[&str]) -> String {
    let out = oracle_command(&python(), module)
        .args(args)
        .output()
        .expect("start python");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "glmcheck_oracle.{module} failed:\n{}\n{stderr}{}",
        String::from_utf8_lossy(&out.stdout),
        if stderr.contains("No module named 'glmcheck_") {
            "\n(the oracle packages are not installed in this interpreter: run scripts/setup-venv)"
        } else {
            ""
        }
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A fresh scratch directory removed at drop.
pub fn scratch() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// The path of the built `glmcheck` binary.
pub fn glmcheck_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_glmcheck"))
}

/// `glmcheck run MODEL` on three tokens, which must fail on its input: exit 2 and a single line
/// on stderr, returned for the caller to check what it names.
pub fn run_error_line(model: &Path) -> String {
    let dir = scratch();
    let trace = dir.path().join("r.trace");
    let out = glmcheck_output(&[
        "run",
        model.to_str().expect("a UTF-8 path"),
        "--tokens",
        "1,2,3",
        "--out",
        trace.to_str().expect("a UTF-8 path"),
    ]);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    err
}

/// `glmcheck ARGS…` run to its end: exit code, stdout and stderr.
pub fn glmcheck_output(args: &[&str]) -> std::process::Output {
    Command::new(glmcheck_bin())
        .args(args)
        .output()
        .expect("start glmcheck")
}

/// `glmcheck ARGS…`, which must succeed; its stdout.
pub fn glmcheck_ok(args: &[&str]) -> String {
    let out = glmcheck_output(args);
    assert!(
        out.status.success(),
        "glmcheck {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run `glmcheck ARGS…` (with `--json` among them), assert its exit code, and parse its stdout.
pub fn glmcheck_json<I, S>(args: I, code: i32) -> serde_json::Value
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out = Command::new(glmcheck_bin())
        .args(args)
        .output()
        .expect("start glmcheck");
    assert_eq!(
        out.status.code(),
        Some(code),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("glmcheck --json prints JSON")
}

/// `glmcheck bisect MODEL --candidate CANDIDATE EXTRA… --json`, its exit code asserted: the
/// diagnosis of another model or an engine's trace against MODEL's reference.
pub fn bisect_candidate(
    model: &Path,
    candidate: &Path,
    extra: &[&str],
    code: i32,
) -> serde_json::Value {
    let mut args = vec![
        "bisect",
        model.to_str().expect("a UTF-8 path"),
        "--candidate",
        candidate.to_str().expect("a UTF-8 path"),
        "--json",
    ];
    args.extend(extra);
    glmcheck_json(args, code)
}

/// `glmcheck synth` of the tiny preset with 8 heads (TP 8 splits them) and 16 indexer heads (no
/// exact DSA ties) to `out`, with `extra` options (`--quant q4_k_m`, `--format hf`, …).
pub fn synth_tiny(out: &Path, extra: &[&str]) {
    let mut args = vec![
        "synth",
        "--set",
        "num_attention_heads=8",
        "--set",
        "index_n_heads=16",
        "--json",
        "--out",
        out.to_str().expect("a UTF-8 path"),
    ];
    args.extend(extra);
    glmcheck_json(args, 0);
}

/// The weights of `model` (a GGUF file or a Hugging Face folder) with its GLM-5 config.
pub fn weight_source(model: &Path) -> glmcheck::exec::source::WeightSource {
    glmcheck::pipeline::Model::open(model)
        .expect("a GLM-5 model")
        .source()
}

/// The score of hypothesis `name` in `endpoint --explain`'s JSON `explanation`; panics, showing
/// the explanation, when it was not ranked.
pub fn explain_score(explanation: &serde_json::Value, name: &str) -> f64 {
    explanation["ranking"]
        .as_array()
        .expect("explanation.ranking")
        .iter()
        .find(|h| h["name"] == name)
        .unwrap_or_else(|| panic!("{name} not ranked: {explanation:#}"))["score"]
        .as_f64()
        .expect("a numeric score")
}
