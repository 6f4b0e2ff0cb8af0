//! A run killed mid-forward leaves a partial trace (`"complete": false`) that `diff` and `gate`
//! open, mark as partial, compare stage by stage and never pass (exit 2 when the stages it holds
//! agree, 1 when one of them breaks).

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use glmcheck::trace::Trace;
use serde_json::Value;

/// How long the killed run may take to write its first layer.
const FIRST_LAYER_WAIT: Duration = Duration::from_secs(120);
const TOKENS: &str = "1,2,3,4";

fn p(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// Whether the trace at `dir` can be opened and holds a stage of layer 0.
fn holds_layer_0(dir: &Path) -> bool {
    Trace::open(dir).is_ok_and(|t| t.stages().iter().any(|s| s.name.starts_with("L0.")))
}

/// Start `glmcheck run` on `model` with a generation that never ends in the test's time, wait
/// (bounded, polling) until layer 0 is on disk, and kill it with SIGKILL.
fn killed_run(model: &Path, out: &Path) {
    let mut child = Command::new(common::glmcheck_bin())
        .args(["run", p(model), "--tokens", TOKENS, "--full", "**"])
        .args(["--generate", "1000000", "--out", p(out)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start glmcheck run");
    let start = Instant::now();
    while !holds_layer_0(out) {
        if let Some(status) = child.try_wait().expect("poll the run") {
            panic!("the run ended ({status}) before it was killed");
        }
        assert!(
            start.elapsed() < FIRST_LAYER_WAIT,
            "no layer 0 in {} after {FIRST_LAYER_WAIT:?}",
            out.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL the run");
    child.wait().expect("reap the run");
}

/// `glmcheck ARGS…`: exit code, stdout as text.
fn glmcheck(args: &[&str]) -> (i32, String) {
    let o = common::glmcheck_output(args);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let code = o.status.code().expect("an exit code");
    assert!(
        code != 2 || text.contains("artial"),
        "glmcheck {args:?}: exit 2 without a partial trace: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    (code, text)
}

fn json(args: &[&str], expect: i32) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    common::glmcheck_json(all, expect)
}

#[test]
fn killed_run_leaves_a_partial_trace_that_diff_and_gate_never_pass() {
    let dir = common::scratch();
    let d = dir.path();
    let model = d.join("m.gguf");
    common::synth_tiny(&model, &["--layers", "6"]);

    let reference = d.join("ref.trace");
    let baseline = d.join("b.json");
    common::glmcheck_ok(&[
        "run",
        p(&model),
        "--tokens",
        TOKENS,
        "--full",
        "**",
        "--out",
        p(&reference),
    ]);
    common::glmcheck_ok(&[
        "gate",
        "--update",
        "--baseline",
        p(&baseline),
        p(&reference),
    ]);
    assert!(Trace::open(&reference).unwrap().manifest().complete);

    let partial = d.join("killed.trace");
    killed_run(&model, &partial);
    let trace = Trace::open(&partial).expect("a killed run's trace opens");
    assert!(!trace.manifest().complete);
    assert!(
        trace.stage("logits", None).is_none(),
        "the run was finished"
    );
    for s in trace.stages() {
        trace
            .tensor(&s.name, s.rank)
            .expect("every recorded stage reads");
    }

    // diff: the stages both hold compared, no divergence among them, never a pass.
    let r = json(&["diff", p(&reference), p(&partial)], 2);
    assert_eq!(r["verdict"], "fail");
    assert_eq!(r["partial"]["candidate"], true);
    assert_eq!(r["partial"]["reference"], false);
    assert!(r["first_divergence"].is_null());
    // Every stage the partial trace holds is compared (top-k gaps explain ties, not judged).
    let held = trace.stages().iter().filter(|s| !s.name.ends_with("_gap"));
    assert_eq!(r["stages"].as_array().unwrap().len(), held.count());
    let r = json(&["diff", p(&partial), p(&reference)], 2);
    assert_eq!(r["partial"]["reference"], true);
    let (code, text) = glmcheck(&["diff", p(&reference), p(&partial)]);
    assert_eq!(code, 2);
    assert!(text.starts_with("PARTIAL"), "{text}");
    assert!(text.contains("the candidate trace is partial"), "{text}");

    // gate: the same, and the unreached records are counted, not judged.
    let g = json(&["gate", "--baseline", p(&baseline), p(&partial)], 2);
    assert_eq!(g["verdict"], "fail");
    assert_eq!(g["partial"], true);
    assert!(g["not_reached"].as_u64().unwrap() > 0);
    let broken: Vec<&Value> = g["stages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["status"] == "fail")
        .collect();
    assert_eq!(broken.len(), 1, "{broken:?}");
    assert_eq!(broken[0]["basis"], "unfinished");
    let (code, text) = glmcheck(&["gate", "--baseline", p(&baseline), p(&partial)]);
    assert_eq!(code, 2);
    assert!(text.starts_with("PARTIAL"), "{text}");
    assert!(text.contains("partial trace"), "{text}");
    // A partial trace is no baseline.
    let o = common::glmcheck_output(&[
        "gate",
        "--update",
        "--baseline",
        p(&d.join("x.json")),
        p(&partial),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("partial trace"));

    // A stage the partial trace holds that breaks is a regression (exit 1), partial or not.
    let broken_dir = d.join("broken.trace");
    std::fs::create_dir(&broken_dir).unwrap();
    for item in std::fs::read_dir(&partial).unwrap() {
        let item = item.unwrap().path();
        std::fs::copy(&item, broken_dir.join(item.file_name().unwrap())).unwrap();
    }
    let manifest = broken_dir.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let stage = m["stages"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|s| s["name"] == "L0.attn_norm")
        .expect("L0.attn_norm recorded");
    let mean = stage["stats"]["mean"].as_f64().unwrap();
    stage["stats"]["mean"] = (mean + 1.0).into();
    let hash: String = stage["stats"]["hash"]
        .as_str()
        .unwrap()
        .chars()
        .rev()
        .collect();
    stage["stats"]["hash"] = hash.into();
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    let g = json(&["gate", "--baseline", p(&baseline), p(&broken_dir)], 1);
    assert_eq!(g["partial"], true);
    let stages = g["stages"].as_array().unwrap();
    let judged = stages
        .iter()
        .find(|s| s["stage"] == "L0.attn_norm")
        .unwrap();
    assert_eq!(judged["status"], "fail");
}

#[test]
fn a_manifest_without_the_field_reads_as_complete() {
    let dir = common::scratch();
    let d = dir.path();
    let model = d.join("m.gguf");
    common::synth_tiny(&model, &["--layers", "1"]);
    let trace = d.join("t.trace");
    common::glmcheck_ok(&["run", p(&model), "--tokens", TOKENS, "--out", p(&trace)]);
    let manifest = trace.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    assert_eq!(m["complete"], true);
    m.as_object_mut().unwrap().remove("complete");
    std::fs::write(&manifest, serde_json::to_vec(&m).unwrap()).unwrap();
    assert!(Trace::open(&trace).unwrap().manifest().complete);
    let r = json(&["diff", p(&trace), p(&trace)], 0);
    assert_eq!(r["verdict"], "pass");
    assert_eq!(r["partial"]["candidate"], false);
}
