//! `glmcheck diff` on real traces of the reference executor: a trace against itself passes with
//! every error exactly zero; the bf16 emulation is judged by the default tolerances or by a
//! bf16 envelope; and traces perturbed at a known stage (scaled, permuted, zeroed, noise added,
//! one NaN, one Inf, another expert choice, a flat lm_head) diverge exactly there, with the
//! fault class the perturbation implies — table-driven, at every layer. Traces of several
//! ranks (disagreeing, sharded, out of order) are in `diff_classify_ranks`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use glmcheck::compare::{diff, DiffOptions, DiffReport, FaultClass, Status};
use glmcheck::trace::{ElemType, FullSelector, Stage, Trace, TraceHeader, TraceWriter};

const TOKENS: &str = "39,100,7,200,5,6,7,8,9,10,11,12";

/// A tiny synthetic model (16 indexer heads: no exact DSA ties) run at `dtypes`, every stage
/// stored in full; the traces' paths in that order.
pub(crate) fn reference_runs(dir: &Path, dtypes: &[&str]) -> Vec<PathBuf> {
    let hf = dir.join("hf");
    let model = hf.to_str().unwrap();
    common::glmcheck_ok(&[
        "synth",
        "--format",
        "hf",
        "--set",
        "index_n_heads=16",
        "--out",
        model,
    ]);
    dtypes
        .iter()
        .enumerate()
        .map(|(i, dtype)| {
            let out = dir.join(format!("{i}-{dtype}.trace"));
            let args = [
                "run", model, "--tokens", TOKENS, "--full", "**", "--dtype", dtype,
            ];
            common::glmcheck_ok(&[&args[..], &["--out", out.to_str().unwrap()]].concat());
            out
        })
        .collect()
}

/// How a stage's values are changed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Perturbation {
    Scale,
    Permute,
    Zero,
    Noise,
    OneNan,
    OneInf,
    OtherExpert,
    FlatLogits,
}

impl Perturbation {
    fn apply(self, v: &mut [f32]) {
        match self {
            Perturbation::Scale => v.iter_mut().for_each(|x| *x *= 1.5),
            Perturbation::Permute => v.reverse(),
            Perturbation::Zero => v.iter_mut().for_each(|x| *x = 0.0),
            Perturbation::Noise => {
                let scale = v.iter().fold(0f32, |m, x| m.max(x.abs())) * 0.05;
                let mut s = 0x9e37_79b9_u32;
                for x in v.iter_mut() {
                    s ^= s << 13;
                    s ^= s >> 17;
                    s ^= s << 5;
                    *x += (s as f32 / u32::MAX as f32 - 0.5) * scale;
                }
            }
            Perturbation::OneNan => v[v.len() / 2] = f32::NAN,
            Perturbation::OneInf => v[v.len() / 3] = f32::INFINITY,
            Perturbation::FlatLogits => v.iter_mut().enumerate().for_each(|(i, x)| {
                *x = 1e-3 * (i % 7) as f32;
            }),
            Perturbation::OtherExpert => unreachable!("ids are changed by `other_expert`"),
        }
    }

    fn expected(self) -> FaultClass {
        match self {
            Perturbation::Scale => FaultClass::ScaleMismatch,
            Perturbation::Permute => FaultClass::WeightLayout,
            Perturbation::Zero | Perturbation::Noise => FaultClass::Unknown,
            Perturbation::OneNan => FaultClass::NanOrigin,
            Perturbation::OneInf => FaultClass::DtypeOverflow,
            Perturbation::OtherExpert => FaultClass::RouterMismatch,
            Perturbation::FlatLogits => FaultClass::FlatLogits,
        }
    }
}

/// The first position's first expert replaced by one it did not choose.
fn other_expert(ids: &mut [i32], k: usize, experts: i32) {
    let chosen = &ids[..k];
    let free = (0..experts).find(|e| !chosen.contains(e)).unwrap();
    ids[0] = free;
}

/// A trace header like `reference`'s (same model and prompt) for a copy written by `backend`.
pub(crate) fn header_like(reference: &Trace, backend: &str, tp: u32) -> TraceHeader {
    let m = reference.manifest();
    TraceHeader {
        producer: m.producer.clone(),
        model: m.model.clone(),
        tokens: m.tokens.clone(),
        backend: backend.into(),
        dtype: m.dtype.clone(),
        tp,
    }
}

/// A copy of `reference` with `stage` perturbed, written to `out` through the trace writer (so
/// its statistics and hashes are the candidate's own).
fn perturbed(reference: &Trace, stage: &str, p: Perturbation, out: &Path) -> Trace {
    perturbed_as(reference, stage, p, out, &["**"], None)
}

/// [`perturbed`], keeping whole only the stages of `full` (the rest as statistics), and with
/// `producer` extra fields in its manifest (a merged engine trace's `disagree`).
pub(crate) fn perturbed_as(
    reference: &Trace,
    stage: &str,
    p: Perturbation,
    out: &Path,
    full: &[&str],
    producer: Option<serde_json::Value>,
) -> Trace {
    let m = reference.manifest();
    let mut header = header_like(reference, "perturbed", reference.manifest().tp);
    if let Some(serde_json::Value::Object(extra)) = producer {
        header.producer.extend(extra);
    }
    let full: Vec<String> = full.iter().map(|g| g.to_string()).collect();
    let mut w = TraceWriter::create(out, header, FullSelector::new(&full).unwrap()).unwrap();
    for s in reference.stages() {
        if s.dtype == ElemType::I32 {
            let mut ids = reference.tensor_i32(&s.name, s.rank).unwrap().unwrap();
            if s.name == stage {
                let k = *s.shape.last().unwrap() as usize;
                other_expert(
                    &mut ids,
                    k,
                    m.model.config["n_routed_experts"].as_i64().unwrap() as i32,
                );
            }
            w.record(&s.name, &s.shape, &s.dims, s.rank, Stage::I32(&ids))
                .unwrap();
        } else {
            let mut v = reference.tensor(&s.name, s.rank).unwrap().unwrap();
            if s.name == stage {
                p.apply(&mut v);
            }
            w.record(&s.name, &s.shape, &s.dims, s.rank, Stage::F32(&v))
                .unwrap();
        }
    }
    w.finish().unwrap();
    Trace::open(out).unwrap()
}

/// A stage kept only as statistics, its values in another order: every moment stays, the
/// sketch does not, and the comparison fails there.
#[test]
fn a_permutation_kept_as_statistics_is_seen_by_the_sketch() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32"]);
    let reference = Trace::open(&runs[0]).unwrap();
    let out = dir.path().join("reversed.trace");
    let cand = perturbed_as(
        &reference,
        "L1.attn.out",
        Perturbation::Permute,
        &out,
        &["logits"],
        None,
    );
    let record = cand.stage("L1.attn.out", None).unwrap();
    assert!(record.file.is_none(), "kept as statistics only");
    let ours = reference.stage("L1.attn.out", None).unwrap();
    // The same values summed in another order: the norms agree to the last bits.
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(b.abs());
    assert!(close(record.stats.l2, ours.stats.l2) && close(record.stats.std, ours.stats.std));
    let report = diff(&reference, &cand, &DiffOptions::default()).unwrap();
    assert_eq!(report.verdict, Status::Fail);
    let d = report.first_divergence.unwrap();
    assert_eq!(d.stage, "L1.attn.out");
    let s = report
        .stages
        .iter()
        .find(|s| s.stage == "L1.attn.out")
        .unwrap();
    assert!(s.rel_diff > 0.1, "the sketch's estimate: {}", s.rel_diff);
}

#[test]
fn a_trace_against_itself_passes_with_every_error_zero() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32", "f32"]);
    for other in &runs {
        let report = diff(
            &Trace::open(&runs[0]).unwrap(),
            &Trace::open(other).unwrap(),
            &DiffOptions::default(),
        )
        .unwrap();
        assert_eq!(report.verdict, Status::Pass);
        assert!(report.fault.is_none() && report.first_divergence.is_none());
        assert!(report.stages.len() > 50, "every stage compared");
        for s in &report.stages {
            assert_eq!(s.rel_diff, 0.0, "{}", s.stage);
            if let Some(m) = &s.metrics {
                assert_eq!(
                    (m.max_abs, m.nmse, m.cosine, m.norm_ratio),
                    (0.0, 0.0, 1.0, 1.0)
                );
            }
        }
    }
}

#[test]
fn bf16_emulation_is_judged_by_default_tolerances_or_its_envelope() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32", "bf16", "bf16"]);
    let [f32_run, bf16_run, envelope] = [0, 1, 2].map(|i| Trace::open(&runs[i]).unwrap());
    let plain = diff(&f32_run, &bf16_run, &DiffOptions::default()).unwrap();
    let beyond = plain.stages.iter().any(|s| s.rel_diff > s.tolerance);
    assert_eq!(
        plain.verdict == Status::Fail,
        beyond,
        "fails only beyond the defaults"
    );
    assert!(
        plain.stages.iter().all(|s| s.tolerance == 1e-3),
        "bf16 default"
    );
    let calibrated = diff(
        &f32_run,
        &bf16_run,
        &DiffOptions {
            envelope: Some(&envelope),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(calibrated.verdict, Status::Pass);
    let class = calibrated.fault.as_ref().map(|f| f.class);
    assert_eq!(
        class,
        Some(FaultClass::PrecisionLoss),
        "beyond f32 noise, within bf16's"
    );
}

/// Every perturbation at every layer it applies to: the first divergence is that stage and
/// the class is the perturbation's.
#[test]
fn perturbed_stages_are_located_and_classified() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32"]);
    let reference = Trace::open(&runs[0]).unwrap();
    use Perturbation::*;
    let mut cases: Vec<(String, Perturbation)> = Vec::new();
    for layer in 0..3 {
        for p in [Scale, Permute, Zero, Noise, OneNan, OneInf] {
            cases.push((format!("L{layer}.attn.out"), p));
        }
        cases.push((format!("L{layer}.ffn_norm"), Scale));
        cases.push((format!("L{layer}.attn.q"), Permute));
    }
    for layer in 1..3 {
        cases.push((format!("L{layer}.moe.topk_ids"), OtherExpert));
        cases.push((format!("L{layer}.moe.routed"), OneNan));
    }
    cases.push(("logits".into(), FlatLogits));
    for (i, (stage, p)) in cases.iter().enumerate() {
        let cand = perturbed(
            &reference,
            stage,
            *p,
            &dir.path().join(format!("p{i}.trace")),
        );
        let report: DiffReport = diff(&reference, &cand, &DiffOptions::default()).unwrap();
        assert_eq!(report.verdict, Status::Fail, "{stage} {p:?}");
        let first = report.first_divergence.as_ref().expect("a divergence");
        assert_eq!(&first.stage, stage, "{p:?}: located");
        let fault = report.fault.as_ref().unwrap();
        assert_eq!(
            fault.class,
            p.expected(),
            "{stage} {p:?}: {}",
            fault.summary
        );
        assert!(!fault.evidence.is_empty(), "{stage} {p:?}: evidence");
    }
}

/// The JSON of a failing diff carries docs/design.md §7's fields and exit code 1; a missing trace is a
/// one-line error with exit code 2.
#[test]
fn json_fields_and_exit_codes() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32"]);
    let reference = Trace::open(&runs[0]).unwrap();
    let cand = perturbed(
        &reference,
        "L1.attn.out",
        Perturbation::Scale,
        &dir.path().join("c.trace"),
    );
    let (r, c) = (runs[0].to_str().unwrap(), cand.dir().to_str().unwrap());
    let json = common::glmcheck_json(["diff", r, c, "--json"], 1);
    assert_eq!(json["verdict"], "fail");
    assert_eq!(json["first_divergence"]["stage"], "L1.attn.out");
    assert_eq!(json["first_divergence"]["layer"], 1);
    assert_eq!(json["fault"]["class"], "scale_mismatch");
    let stage = json["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == "L1.attn.out");
    let stage = stage.unwrap();
    for field in [
        "status",
        "cosine",
        "rel_diff",
        "nmse",
        "max_abs",
        "norm_ratio",
        "sqnr_db",
    ] {
        assert!(stage.get(field).is_some(), "stage field {field}");
    }
    // Every stage before the perturbed one matched exactly: its error is made there, by no
    // finite factor, and the terminal table says so in words.
    assert_eq!(stage["amplification"], "made here");
    let table = common::glmcheck_output(&["diff", r, c]);
    let row = String::from_utf8_lossy(&table.stdout)
        .lines()
        .find(|l| l.contains("▶ L1.attn.out"))
        .map(str::to_string)
        .expect("the first divergence in the stage table");
    assert!(row.contains("made here"), "{row}");
    assert_eq!(
        common::glmcheck_json(["diff", r, r, "--json"], 0)["verdict"],
        "pass"
    );
    let out = Command::new(common::glmcheck_bin())
        .args(["diff", r, "/nonexistent.trace"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.lines().count() == 1 && err.contains("/nonexistent.trace"),
        "{err}"
    );
}

/// `glmcheck logits`: its entropy, top-1 probability and KL statistics are torch's; healthy
/// logits pass, a flat lm_head and one token at every position fail.
#[test]
fn logits_statistics_agree_with_torch_and_catch_garbage() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32", "bf16"]);
    let (r, c) = (runs[0].to_str().unwrap(), runs[1].to_str().unwrap());
    let ours = common::glmcheck_json(["logits", c, "--reference", r, "--json"], 0);
    let torch: serde_json::Value =
        serde_json::from_str(&common::run_oracle("trace.logits_stats", &[r, c])).unwrap();
    // KL sums p·(ln p − ln q) over the vocabulary: differences of logs cancel, so two f64
    // implementations agree to about 1e-15 absolute, not relative.
    let close = |a: &serde_json::Value, b: &serde_json::Value, what: &str| {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        assert!(
            (a - b).abs() <= 1e-9 * b.abs() + 1e-13,
            "{what}: {a} vs torch {b}"
        );
    };
    close(
        &ours["health"]["entropy_mean"],
        &torch["entropy_mean"],
        "entropy",
    );
    close(
        &ours["health"]["top1_prob_mean"],
        &torch["top1_prob_mean"],
        "top-1 probability",
    );
    let cmp = &ours["reference"]["comparison"];
    close(&cmp["kl_mean"], &torch["kl_mean"], "KL mean");
    close(&cmp["kl_max"], &torch["kl_max"], "KL max");
    close(
        &cmp["top1_agreement"],
        &torch["top1_agreement"],
        "top-1 agreement",
    );

    let reference = Trace::open(&runs[0]).unwrap();
    let flat = perturbed(
        &reference,
        "logits",
        Perturbation::FlatLogits,
        &dir.path().join("f.trace"),
    );
    let json = common::glmcheck_json(["logits", flat.dir().to_str().unwrap(), "--json"], 1);
    assert_eq!(json["verdict"], "fail");
    assert_eq!(json["health"]["flat"], true);
    // One token on top everywhere, the `$\ $\ $\` signature.
    let vocab = reference.stage("logits", None).unwrap().shape[1] as usize;
    let mut repeated = reference.tensor("logits", None).unwrap().unwrap();
    repeated.chunks_mut(vocab).for_each(|row| row[3] = 100.0);
    let out = dir.path().join("repeat.trace");
    let header = header_like(&reference, "test", 1);
    let mut w = TraceWriter::create(&out, header, FullSelector::new(&["logits"]).unwrap()).unwrap();
    let shape = reference.stage("logits", None).unwrap().shape.clone();
    w.record("logits", &shape, "t v(tp)", None, Stage::F32(&repeated))
        .unwrap();
    w.finish().unwrap();
    let json = common::glmcheck_json(["logits", out.to_str().unwrap(), "--json"], 1);
    assert_eq!(json["health"]["longest_repeat"], 12);
}

/// transformers in bf16 breaks a DSA near tie differently from the reference (its indexer
/// scores round differently): reported as precision loss with the reference's gap as evidence,
/// not as a fault.
#[test]
fn near_tie_flips_of_transformers_in_bf16_are_precision_loss() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32", "bf16"]);
    let hf_bf16 = dir.path().join("hf-bf16.trace");
    let out = Command::new(common::python())
        .args(["-m", "glmcheck_probe.transformers_probe"])
        .arg(dir.path().join("hf"))
        .args([
            "--tokens", TOKENS, "--full", "**", "--dtype", "bf16", "--out",
        ])
        .arg(&hf_bf16)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let [reference, envelope, candidate] =
        [&runs[0], &runs[1], &hf_bf16].map(|p| Trace::open(p).unwrap());
    assert_eq!(candidate.manifest().dtype, "bf16");
    let opts = DiffOptions {
        envelope: Some(&envelope),
        ..Default::default()
    };
    let report = diff(&reference, &candidate, &opts).unwrap();
    let flipped = report
        .stages
        .iter()
        .any(|s| s.basis == glmcheck::compare::stage_diff::Basis::Ids && s.rel_diff > 0.0);
    assert!(flipped, "this seed's bf16 run flips a DSA near tie");
    let fault = report.fault.expect("a finding");
    assert_eq!(fault.class, FaultClass::PrecisionLoss, "{}", fault.summary);
    assert!(fault.summary.contains("near ties"), "{}", fault.summary);
    assert!(
        fault.evidence.iter().any(|e| e.contains("reference gap")),
        "{:?}",
        fault.evidence
    );
}

/// A candidate that disagrees on shapes (another vocabulary, another top-k width) or lacks
/// stages is a failing comparison, never a crash; mismatched logits for `logits` are a one-line
/// error.
#[test]
fn mismatched_shapes_and_missing_stages_are_findings_not_crashes() {
    let dir = common::scratch();
    let runs = reference_runs(dir.path(), &["f32"]);
    let reference = Trace::open(&runs[0]).unwrap();
    let header = header_like(&reference, "odd", 1);
    let out = dir.path().join("odd.trace");
    let mut w = TraceWriter::create(&out, header, FullSelector::new(&["**"]).unwrap()).unwrap();
    for s in reference.stages() {
        match s.name.as_str() {
            "L0.attn.q" => continue,
            "logits" => {
                let v = reference.tensor("logits", None).unwrap().unwrap();
                let cut: Vec<f32> = v
                    .chunks(s.shape[1] as usize)
                    .flat_map(|r| r[..100].to_vec())
                    .collect();
                w.record(
                    "logits",
                    &[s.shape[0], 100],
                    &s.dims,
                    None,
                    Stage::F32(&cut),
                )
                .unwrap();
            }
            name if name.ends_with("moe.topk_ids") => {
                let ids = reference.tensor_i32(name, None).unwrap().unwrap();
                let first: Vec<i32> = ids.chunks(s.shape[1] as usize).map(|r| r[0]).collect();
                w.record(name, &[s.shape[0], 1], &s.dims, None, Stage::I32(&first))
                    .unwrap();
            }
            name if s.dtype == ElemType::I32 => {
                let ids = reference.tensor_i32(name, None).unwrap().unwrap();
                w.record(name, &s.shape, &s.dims, None, Stage::I32(&ids))
                    .unwrap();
            }
            name => {
                let v = reference.tensor(name, None).unwrap().unwrap();
                w.record(name, &s.shape, &s.dims, None, Stage::F32(&v))
                    .unwrap();
            }
        }
    }
    w.finish().unwrap();
    let cand = Trace::open(&out).unwrap();
    let report = diff(&reference, &cand, &DiffOptions::default()).unwrap();
    assert_eq!(report.verdict, Status::Fail);
    assert_eq!(
        report.first_divergence.unwrap().stage,
        "L1.moe.topk_ids",
        "first shape change"
    );
    assert!(
        !report.stages.iter().any(|s| s.stage == "L0.attn.q"),
        "missing stage skipped"
    );
    let logits = report.stages.iter().find(|s| s.stage == "logits").unwrap();
    assert_eq!((logits.status, logits.rel_diff), (Status::Fail, 1.0));
    let run = Command::new(common::glmcheck_bin())
        .args([
            "logits",
            out.to_str().unwrap(),
            "--reference",
            runs[0].to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.lines().count() == 1 && err.contains("logits of"),
        "{err}"
    );
}
