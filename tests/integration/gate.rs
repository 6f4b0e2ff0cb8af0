//! `glmcheck gate`: a baseline passes its own run and candidates one ulp away (every value moved
//! one ulp of the run's dtype, and the f64 reference rounded to f32), fails planted faults of
//! the catalogue naming the stage, refuses wrong comparisons and broken baseline files with exit
//! 2 and a one-line reason, writes JUnit XML that parses with the right failure count, and
//! `--update` round-trips; `scripts/gate-golden` passes against golden/ and fails on a fault.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use glmcheck::gate::Baseline;
use glmcheck::trace::{ElemType, FullSelector, Stage, Trace, TraceHeader, TraceWriter};

/// The prompt of the golden baselines (scripts/gate-golden).
const PROMPT: &str = "The capital of France is Paris. The capital of Germany is";

fn code(out: &Output) -> i32 {
    out.status.code().expect("exit code")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn p(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// The tiny preset as golden/ uses it: Q4_K_M GGUF, seed 0.
fn tiny(dir: &Path) -> PathBuf {
    let out = dir.join("tiny.gguf");
    common::glmcheck_json(
        [
            "synth",
            "--preset",
            "tiny",
            "--quant",
            "q4_k_m",
            "--json",
            "--out",
            p(&out),
        ],
        0,
    );
    out
}

/// `glmcheck run` of `model` into `out` with every stage in full.
fn run_full(model: &Path, out: &Path, dtype: &str, tp: u32) {
    let tp = tp.to_string();
    let o = common::glmcheck_output(&[
        "run",
        p(model),
        "--prompt",
        PROMPT,
        "--dtype",
        dtype,
        "--tp",
        &tp,
        "--full",
        "**",
        "--out",
        p(out),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// Gate with `--json`, assert the exit code, parse the report.
fn gate_json(args: &[&str], expect: i32) -> serde_json::Value {
    let mut all = vec!["gate", "--json"];
    all.extend(args);
    let o = common::glmcheck_output(&all);
    assert_eq!(code(&o), expect, "{all:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("gate --json prints JSON")
}

/// A copy of the trace `src` at `dst` whose every float value is `f(value)` (ids unchanged),
/// with statistics recomputed by the trace writer and the manifest's dtype set to `dtype`.
fn rewrite(src: &Path, dst: &Path, dtype: &str, f: impl Fn(f32) -> f32) {
    let t = Trace::open(src).unwrap();
    let m = t.manifest();
    let header = TraceHeader {
        producer: m.producer.clone(),
        model: m.model.clone(),
        tokens: m.tokens.clone(),
        backend: m.backend.clone(),
        dtype: dtype.into(),
        tp: m.tp,
    };
    let mut w = TraceWriter::create(dst, header, FullSelector::new(&["**"]).unwrap()).unwrap();
    for s in t.stages() {
        if s.dtype == ElemType::I32 {
            let ids = t.tensor_i32(&s.name, s.rank).unwrap().expect("full ids");
            w.record(&s.name, &s.shape, &s.dims, s.rank, Stage::I32(&ids))
                .unwrap();
        } else {
            // f64 stages arrive rounded to nearest f32.
            let v: Vec<f32> = t
                .tensor(&s.name, s.rank)
                .unwrap()
                .expect("full values")
                .into_iter()
                .map(&f)
                .collect();
            w.record(&s.name, &s.shape, &s.dims, s.rank, Stage::F32(&v))
                .unwrap();
        }
    }
    w.finish().unwrap();
}

/// `x` moved one ulp of f32 away from zero (zeros and non-finite values stay).
fn f32_ulp(x: f32) -> f32 {
    if x == 0.0 || !x.is_finite() {
        x
    } else {
        f32::from_bits(x.to_bits() + 1)
    }
}

/// `x` moved one ulp of bf16 (2⁻⁷ of its binade) away from zero: a bf16 value to the next
/// one; stages a bf16 engine keeps in f32 (router logits, routing weights) by the same step.
fn bf16_ulp(x: f32) -> f32 {
    if x == 0.0 || !x.is_finite() {
        x
    } else {
        f32::from_bits(x.to_bits() + 0x1_0000)
    }
}

fn failing_stages(report: &serde_json::Value) -> Vec<(String, Option<u64>)> {
    report["stages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["status"] == "fail")
        .map(|s| (s["stage"].as_str().unwrap().to_string(), s["rank"].as_u64()))
        .collect()
}

#[test]
fn a_baseline_passes_itself_and_candidates_one_ulp_away() {
    let dir = common::scratch();
    let d = dir.path();
    let model = tiny(d);
    for (dtype, tp, ulp) in [("f32", 1, f32_ulp as fn(f32) -> f32), ("bf16", 2, bf16_ulp)] {
        let reference = d.join(format!("ref-{dtype}.trace"));
        run_full(&model, &reference, dtype, tp);
        let base = d.join(format!("{dtype}.json"));
        let o =
            common::glmcheck_output(&["gate", "--update", "--baseline", p(&base), p(&reference)]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let b = Baseline::load(&base).unwrap();
        assert_eq!((b.dtype.as_str(), b.tp), (dtype, tp));
        assert!(b.logits.is_some() && b.stages.len() > 40);

        // Itself: every record bit-identical.
        let r = gate_json(&["--baseline", p(&base), p(&reference)], 0);
        assert_eq!(r["verdict"], "pass");
        assert_eq!(r["failed"], 0);
        let stages = r["stages"].as_array().unwrap();
        assert!(stages[..stages.len() - 1]
            .iter()
            .all(|s| s["basis"] == "identical"));

        // Every value one ulp of the dtype away from zero: no float record is identical any
        // more, each moved by less than its limit.
        let nudged = d.join(format!("nudged-{dtype}.trace"));
        rewrite(&reference, &nudged, dtype, ulp);
        let r = gate_json(&["--baseline", p(&base), p(&nudged)], 0);
        assert_eq!(r["verdict"], "pass", "{r:#}");
        let moved = r["stages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["basis"] == "stats")
            .inspect(|s| {
                let used = s["headroom_used"].as_f64().unwrap();
                assert!(used > 0.0 && used <= 1.0, "{s}");
            })
            .count();
        let floats = b
            .stages
            .iter()
            .filter(|s| s.dtype != ElemType::I32 && s.stats.count > s.stats.zeros)
            .count();
        assert_eq!(
            moved, floats,
            "every float record with a non-zero value moved"
        );
        let worst = r["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["headroom_used"].as_f64().unwrap())
            .fold(0.0, f64::max);
        eprintln!("{dtype} one ulp: {moved} records moved, largest share of a limit used {worst}");
    }

    // The f32 reference's own rounding: the same model run in f64, rounded to f32.
    let f64_trace = d.join("ref-f64.trace");
    run_full(&model, &f64_trace, "f64", 1);
    let rounded = d.join("f64-as-f32.trace");
    rewrite(&f64_trace, &rounded, "f32", |x| x);
    let r = gate_json(&["--baseline", p(&d.join("f32.json")), p(&rounded)], 0);
    assert_eq!(r["verdict"], "pass", "{r:#}");
    let worst = r["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["headroom_used"].as_f64().unwrap())
        .fold(0.0, f64::max);
    eprintln!("f64 rounded to f32: largest share of a limit used {worst}");
    assert!(
        worst > 0.0 && worst < 1.0,
        "the f64 run departs, within ε: {worst}"
    );
}

#[test]
fn planted_faults_fail_naming_the_stage() {
    let dir = common::scratch();
    let d = dir.path();
    let model = tiny(d);
    let base = |dtype: &str, tp: u32| {
        let path = d.join(format!("tiny-{dtype}-tp{tp}.json"));
        let tp = tp.to_string();
        let o = common::glmcheck_output(&[
            "gate",
            "--update",
            "--baseline",
            p(&path),
            p(&model),
            "--dtype",
            dtype,
            "--tp",
            &tp,
            "--prompt",
            PROMPT,
        ]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        path
    };
    let (f32_tp1, f32_tp2, bf16_tp2) = (base("f32", 1), base("f32", 2), base("bf16", 2));

    // The clean model, run here with the baseline's settings: bit-identical.
    for b in [&f32_tp1, &f32_tp2, &bf16_tp2] {
        let r = gate_json(&["--baseline", p(b), p(&model)], 0);
        assert_eq!(r["failed"], 0);
    }

    // (baseline, fault, first broken stage and rank, a check that broke there)
    type Case<'a> = (&'a PathBuf, &'a str, (&'a str, Option<u64>), &'a str);
    let cases: [Case; 6] = [
        (&f32_tp1, "flat-lm-head", ("logits", None), "l2"),
        (&f32_tp1, "dequant-q4k-scales", ("embed", None), "mean"),
        (&f32_tp1, "nan-expert", ("L1.moe.routed", None), "nan"),
        (&f32_tp2, "skip-all-reduce", ("L0.attn.out", None), "l2"),
        (&bf16_tp2, "skip-all-reduce", ("L0.attn.out", None), "l2"),
        (
            &bf16_tp2,
            "unsharded-column",
            ("L0.attn.kv", Some(1)),
            "max",
        ),
    ];
    for (b, fault, (stage, rank), check) in cases {
        let r = gate_json(&["--baseline", p(b), p(&model), "--inject", fault], 1);
        assert_eq!(r["verdict"], "fail");
        let failing = failing_stages(&r);
        assert_eq!(
            failing[0],
            (stage.to_string(), rank),
            "{fault}: {failing:?}"
        );
        let first = r["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["status"] == "fail")
            .unwrap();
        let checks: Vec<&str> = first["failures"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["check"].as_str().unwrap())
            .collect();
        assert!(checks.contains(&check), "{fault}: {checks:?}");
        // Every failure carries its numbers.
        for f in first["failures"].as_array().unwrap() {
            if f["check"] != "nan" {
                let (bv, cv, lim) = (&f["baseline"], &f["candidate"], &f["limit"]);
                let delta = (bv.as_f64().unwrap() - cv.as_f64().unwrap()).abs();
                assert!(delta > lim.as_f64().unwrap(), "{f}");
            }
        }
    }

    // Flat logits are named as such, position by position, on the terminal too.
    let o = common::glmcheck_output(&[
        "gate",
        "--baseline",
        p(&f32_tp1),
        p(&model),
        "--inject",
        "flat-lm-head",
    ]);
    assert_eq!(code(&o), 1);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.starts_with("REGRESSION"), "{text}");
    assert!(
        text.contains("flat logits") && text.contains("top1[0]"),
        "{text}"
    );
    assert!(text.contains("first broken stage: logits"), "{text}");
}

#[test]
fn wrong_comparisons_and_broken_baselines_exit_2_with_one_line() {
    let dir = common::scratch();
    let d = dir.path();
    let model = tiny(d);
    let base = d.join("b.json");
    let o = common::glmcheck_output(&[
        "gate",
        "--update",
        "--baseline",
        p(&base),
        p(&model),
        "--prompt",
        PROMPT,
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
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

/// A bf16 baseline keeps its near ties with the choices made there, and a model candidate run by
/// the gate takes exactly those choices, so that a tie broken the other way by another CPU's
/// summation order does not move every later stage. Shown by planting another choice at one
/// near tie of the baseline: the candidate's run records the planted ids at that position.
#[test]
fn a_model_candidate_takes_the_baselines_choices_at_its_near_ties() {
    let dir = common::scratch();
    let d = dir.path();
    let model = tiny(d);
    let base = d.join("bf16.json");
    let o = common::glmcheck_output(&[
        "gate",
        "--update",
        "--baseline",
        p(&base),
        p(&model),
        "--dtype",
        "bf16",
        "--prompt",
        PROMPT,
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let b = Baseline::load(&base).unwrap();
    let (at, stage) = b
        .stages
        .iter()
        .enumerate()
        .find(|(_, s)| s.name.ends_with(".moe.topk_ids") && !s.near_ties.is_empty())
        .expect("the tiny bf16 run has near ties at the router's top-k boundary");
    assert!(stage.min_gap_ratio.unwrap() <= b.limits.epsilon);
    let (position, ids) = stage.near_ties[0].clone();
    // The smallest expert the run did not choose there (below k + 1 ≤ the expert count).
    let other = (0..).find(|e| !ids.contains(e)).unwrap();
    let mut planted = ids.clone();
    *planted.last_mut().unwrap() = other;

    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
    value["stages"][at]["near_ties"][0][1] = serde_json::json!(planted);
    let edited = d.join("planted-tie.json");
    std::fs::write(&edited, value.to_string()).unwrap();
    let out = d.join("candidate.trace");
    let o = common::glmcheck_output(&[
        "gate",
        "--json",
        "--baseline",
        p(&edited),
        p(&model),
        "--out",
        p(&out),
    ]);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let taken = b.tie_breaks().count();
    assert!(
        report["notes"].as_array().unwrap().iter().any(|n| n
            .as_str()
            .unwrap()
            .starts_with(&format!("{taken} top-k positions were near ties"))),
        "{report:#}"
    );
    let trace = Trace::open(&out).unwrap();
    let (values, shape) = {
        let r = trace.stage(&stage.name, None).unwrap();
        (
            trace.tensor(&stage.name, None).unwrap().unwrap(),
            r.shape.clone(),
        )
    };
    let k = *shape.last().unwrap() as usize;
    let row: Vec<i32> = values[position * k..(position + 1) * k]
        .iter()
        .map(|&v| v as i32)
        .collect();
    let sorted = |mut v: Vec<i32>| {
        v.sort_unstable();
        v
    };
    assert_eq!(
        sorted(row),
        sorted(planted),
        "{}: position {position}",
        stage.name
    );
}

#[test]
fn junit_markdown_and_update_round_trip() {
    let dir = common::scratch();
    let d = dir.path();
    let model = tiny(d);
    let base = d.join("b.json");
    let update = |path: &Path| {
        let o = common::glmcheck_output(&[
            "gate",
            "--update",
            "--baseline",
            p(path),
            p(&model),
            "--tp",
            "2",
            "--dtype",
            "bf16",
            "--prompt",
            PROMPT,
        ]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    };
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
