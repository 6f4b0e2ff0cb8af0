//! `glmcheck gate` around the comparison (the helpers of `gate`): wrong comparisons and broken
//! baseline files exit 2 with a one-line reason, JUnit XML parses with the right failure count,
//! the Markdown summary and `--update` round-trip, and `scripts/gate-golden` passes against
//! golden/ and fails on a fault.

use crate::common;
use crate::gate::{code, gate_json, p, run_full, stderr, tiny, update_from_model};

use std::path::Path;
use std::process::{Command, Output};

use glmcheck::gate::Baseline;

#[test]
fn wrong_comparisons_and_broken_baselines_exit_2_with_one_line() {
    let dir = common::scratch();
    let d = dir.path();
    let model = tiny(d);
    let base = d.join("b.json");
    update_from_model(&base, &model, &[]);
    let one_line = |o: &Output, needles: &[&str]| {
        assert_eq!(code(o), 2, "{}", stderr(o));
        let e = stderr(o);
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
        for n in needles {
            assert!(e.contains(n), "`{n}` not in: {e}");
        }
    };

    // Another dtype, TP or prompt than the baseline's.
    one_line(
        &common::glmcheck_output(&["gate", "--baseline", p(&base), p(&model), "--dtype", "bf16"]),
        &[
            "dtype bf16 differs from the baseline's f32",
            "not a regression",
        ],
    );
    one_line(
        &common::glmcheck_output(&["gate", "--baseline", p(&base), p(&model), "--tp", "2"]),
        &["tp 2 differs from the baseline's 1"],
    );
    one_line(
        &common::glmcheck_output(&[
            "gate",
            "--baseline",
            p(&base),
            p(&model),
            "--tokens",
            "1,2,3",
        ]),
        &["prompt tokens differ"],
    );
    // Another model: other storage types give another fingerprint.
    let other = d.join("other.gguf");
    common::glmcheck_json(
        ["synth", "--preset", "tiny", "--json", "--out", p(&other)],
        0,
    );
    one_line(
        &common::glmcheck_output(&["gate", "--baseline", p(&base), p(&other)]),
        &["fingerprint", "differs from the baseline's"],
    );
    // No baseline.
    let absent = d.join("absent.json");
    one_line(
        &common::glmcheck_output(&["gate", "--baseline", p(&absent), p(&model)]),
        &[p(&absent), "no such baseline", "--update"],
    );

    // Broken files: each message names the file and the field.
    let text = std::fs::read_to_string(&base).unwrap();
    let mut value: serde_json::Value = serde_json::from_str(&text).unwrap();
    let hostile = |name: &str, content: String, needles: &[&str]| {
        let path = d.join(name);
        std::fs::write(&path, content).unwrap();
        let mut all = vec![p(&path)];
        all.extend(needles);
        one_line(
            &common::glmcheck_output(&["gate", "--baseline", p(&path), p(&model)]),
            &all,
        );
    };
    hostile(
        "truncated.json",
        text[..text.len() / 2].to_string(),
        &["broken JSON at line"],
    );
    hostile("empty.json", String::new(), &["broken JSON"]);
    hostile("array.json", "[1, 2]".into(), &["not a JSON object"]);
    let mut v = value.clone();
    v["format"] = "glmcheck-trace".into();
    hostile(
        "format.json",
        v.to_string(),
        &["format", "glmcheck-baseline"],
    );
    let mut v = value.clone();
    v["version"] = 7.into();
    hostile("version.json", v.to_string(), &["version: 7"]);
    let mut v = value.clone();
    v["stages"][3]["stats"]["std"] = (-1.0).into();
    let name3 = value["stages"][3]["name"].as_str().unwrap().to_string();
    hostile(
        "std.json",
        v.to_string(),
        &[&format!("stages[3] \"{name3}\" stats.std: -1 is negative")],
    );
    let mut v = value.clone();
    v["stages"][2]["stats"]
        .as_object_mut()
        .unwrap()
        .remove("mean");
    hostile(
        "mean.json",
        v.to_string(),
        &["stages[2]", "missing field `mean`"],
    );
    let mut v = value.clone();
    v["stages"][1]["shape"] = serde_json::json!([4294967296u64, 4294967296u64, 16]);
    hostile(
        "shape.json",
        v.to_string(),
        &["stages[1]", "shape", "does not hold"],
    );
    let mut v = value.clone();
    v["stages"][0]["epsilon"] = 5.into();
    hostile("eps.json", v.to_string(), &["stages[0]", "epsilon: 5"]);
    let mut v = value.clone();
    v["stages"][0]["epsilom"] = 0.1.into();
    hostile(
        "typo.json",
        v.to_string(),
        &["stages[0]", "unknown field `epsilom`"],
    );
    let mut v = value.clone();
    v["logits"]["top1"][0] = 100000.into();
    hostile(
        "top1.json",
        v.to_string(),
        &["logits.top1[0]", "not below vocab"],
    );
    let mut v = value.clone();
    v["logits"]["entropy"].as_array_mut().unwrap().pop();
    hostile(
        "entropy.json",
        v.to_string(),
        &["logits.entropy", "entries for"],
    );
    let mut v = value.clone();
    v["tp"] = 0.into();
    hostile("tp.json", v.to_string(), &["tp: 0"]);
    let mut v = value.clone();
    v["dtype"] = "fp8".into();
    hostile("dtype.json", v.to_string(), &["dtype: `fp8`"]);
    let topk = value["stages"]
        .as_array()
        .unwrap()
        .iter()
        .position(|s| s["name"].as_str().unwrap().ends_with(".moe.topk_ids"))
        .unwrap();
    let mut v = value.clone();
    v["stages"][topk]["near_ties"] = serde_json::json!([[9999, [1, 2]]]);
    hostile(
        "ties.json",
        v.to_string(),
        &[&format!("stages[{topk}]"), "near_ties: position 9999"],
    );
    value["stages"][4]["rank"] = 3.into();
    hostile(
        "rank.json",
        value.to_string(),
        &["stages[4]", "rank: 3 is not below tp = 1"],
    );

    // A trace candidate takes no run options.
    let trace = d.join("t.trace");
    run_full(&model, &trace, "f32", 1);
    one_line(
        &common::glmcheck_output(&["gate", "--baseline", p(&base), p(&trace), "--tp", "2"]),
        &["--tp applies to a model candidate"],
    );
}

#[test]
fn junit_markdown_and_update_round_trip() {
    let dir = common::scratch();
    let d = dir.path();
    let model = tiny(d);
    let base = d.join("b.json");
    let update = |path: &Path| update_from_model(path, &model, &["--tp", "2", "--dtype", "bf16"]);
    update(&base);
    // Deterministic and stable: the same run writes the same bytes, and reading then writing
    // gives them back.
    let again = d.join("again.json");
    update(&again);
    let text = std::fs::read_to_string(&base).unwrap();
    assert_eq!(text, std::fs::read_to_string(&again).unwrap());
    let b = Baseline::load(&base).unwrap();
    assert_eq!(b.to_json(), text);
    // One stage per line, in the trace's order.
    let lines: Vec<&str> = text.lines().collect();
    let first_stage = lines
        .iter()
        .position(|l| l.contains("\"name\":\"embed\""))
        .unwrap();
    for (i, s) in b.stages.iter().enumerate() {
        let line = lines[first_stage + i];
        assert!(
            line.starts_with(&format!("    {{\"name\":\"{}\"", s.name)),
            "{line}"
        );
    }

    // A failing gate's JUnit XML: one testcase per judged record, failures as reported.
    let (xml, md) = (d.join("gate.xml"), d.join("gate.md"));
    let r = gate_json(
        &[
            "--baseline",
            p(&base),
            p(&model),
            "--inject",
            "double-all-reduce",
            "--junit",
            p(&xml),
            "--markdown",
            p(&md),
        ],
        1,
    );
    let (checked, failed) = (
        r["checked"].as_u64().unwrap(),
        r["failed"].as_u64().unwrap(),
    );
    assert!(failed > 10 && checked > failed);
    let parsed = Command::new(common::python())
        .arg("-c")
        .arg(
            "import sys, xml.etree.ElementTree as ET\n\
             root = ET.parse(sys.argv[1]).getroot()\n\
             suite = root.find('testsuite')\n\
             cases = suite.findall('testcase')\n\
             failing = [c for c in cases if c.find('failure') is not None]\n\
             print(root.tag, suite.get('tests'), suite.get('failures'), len(cases), len(failing), failing[0].get('name'))\n\
             print(failing[0].find('failure').get('message'))",
        )
        .arg(&xml)
        .output()
        .unwrap();
    assert!(parsed.status.success(), "{}", stderr(&parsed));
    let out = String::from_utf8_lossy(&parsed.stdout);
    let mut lines = out.lines();
    let head: Vec<&str> = lines.next().unwrap().split(' ').collect();
    assert_eq!(head[0], "testsuites");
    assert_eq!(
        head[1..5],
        [checked, failed, checked, failed].map(|n| n.to_string())
    );
    assert_eq!(head[5..].join(" "), "L0.attn.out");
    let message = lines.next().unwrap();
    assert!(message.starts_with("L0.attn.out: l2: |Δ| = "), "{message}");

    let md = std::fs::read_to_string(&md).unwrap();
    assert!(md.starts_with("### glmcheck gate: ❌ regression"), "{md}");
    assert!(
        md.contains(&format!("{failed} of {checked} checks broke")),
        "{md}"
    );
    assert!(md.contains("| `L0.attn.out` | l2 |"), "{md}");
}

#[test]
fn the_golden_gate_passes_and_fails_on_a_planted_fault() {
    let script = common::root().join("scripts/gate-golden");
    let run = |extra: &[&str]| {
        Command::new(&script)
            .args(["--only", "tiny", "--tp", "2"])
            .args(extra)
            .env("GLMCHECK_BIN", common::glmcheck_bin())
            .output()
            .unwrap()
    };
    let clean = run(&[]);
    let out = String::from_utf8_lossy(&clean.stdout);
    assert_eq!(code(&clean), 0, "{out}{}", stderr(&clean));
    assert!(
        out.contains("gate tiny-f32-tp2: exit 0") && out.contains("gate tiny-bf16-tp2: exit 0")
    );
    let faulty = run(&["--inject", "skip-all-reduce"]);
    let out = String::from_utf8_lossy(&faulty.stdout);
    assert_eq!(code(&faulty), 1, "{out}{}", stderr(&faulty));
    assert!(out.contains("first broken stage: L0.attn.out"), "{out}");
}
