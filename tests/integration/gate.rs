//! `glmcheck gate`: a baseline passes its own run and candidates one ulp away (every value moved
//! one ulp of the run's dtype, and the f64 reference rounded to f32), fails planted faults of
//! the catalogue naming the stage, and a model candidate takes the baseline's choices at its
//! near ties. What the gate refuses, the reports it writes, `--update` and `scripts/gate-golden`
//! are in `gate_reports`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use glmcheck::gate::Baseline;
use glmcheck::trace::{ElemType, FullSelector, Stage, Trace, TraceHeader, TraceWriter};

/// The prompt of the golden baselines (scripts/gate-golden).
pub(crate) const PROMPT: &str = "The capital of France is Paris. The capital of Germany is";

pub(crate) fn code(out: &Output) -> i32 {
    out.status.code().expect("exit code")
}

pub(crate) fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub(crate) fn p(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// The tiny preset as golden/ uses it: Q4_K_M GGUF, seed 0.
pub(crate) fn tiny(dir: &Path) -> PathBuf {
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
pub(crate) fn run_full(model: &Path, out: &Path, dtype: &str, tp: u32) {
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
pub(crate) fn gate_json(args: &[&str], expect: i32) -> serde_json::Value {
    let mut all = vec!["gate", "--json"];
    all.extend(args);
    let o = common::glmcheck_output(&all);
    assert_eq!(code(&o), expect, "{all:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("gate --json prints JSON")
}

/// `gate --update --baseline BASE MODEL --prompt PROMPT` with `options`: a model run here made
/// into a baseline, which must succeed.
pub(crate) fn update_from_model(base: &Path, model: &Path, options: &[&str]) {
    let mut args = vec!["gate", "--update", "--baseline", p(base), p(model)];
    args.extend_from_slice(options);
    args.extend_from_slice(&["--prompt", PROMPT]);
    let o = common::glmcheck_output(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
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
        update_from_model(&path, &model, &["--dtype", dtype, "--tp", &tp.to_string()]);
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
    update_from_model(&base, &model, &["--dtype", "bf16"]);
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
