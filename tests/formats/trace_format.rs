//! Traces: the writer, the reader and the Python oracle (`glmcheck_oracle.trace.check`) agree on
//! every statistic, hash and stored bit; broken manifests fail naming the field. The sample trace
//! written here is also the one `trace_format_writer` writes in other ways.

use crate::common;

use std::fs;
use std::path::{Path, PathBuf};

use glmcheck::trace::stats::StatsLater;
use glmcheck::trace::{
    FullSelector, ModelInfo, OwnedStage, Stage, TensorStats, Trace, TraceHeader, TraceWriter,
};
use serde_json::{json, Value};

/// Deterministic pseudo-random f32 in [-scale, scale).
pub(crate) fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// One stage the sample run records.
pub(crate) struct Sample {
    pub(crate) name: &'static str,
    pub(crate) shape: Vec<u64>,
    pub(crate) dims: &'static str,
    pub(crate) rank: Option<u32>,
    pub(crate) f32s: Vec<f32>,
    pub(crate) f64s: Vec<f64>,
    pub(crate) i32s: Vec<i32>,
}

impl Sample {
    pub(crate) fn f32(
        name: &'static str,
        shape: &[u64],
        dims: &'static str,
        rank: Option<u32>,
        v: Vec<f32>,
    ) -> Self {
        Sample {
            name,
            shape: shape.to_vec(),
            dims,
            rank,
            f32s: v,
            f64s: Vec::new(),
            i32s: Vec::new(),
        }
    }
    /// An f64 stage (a `--dtype f64` run), from f32 noise plus a part f32 cannot hold.
    pub(crate) fn f64(name: &'static str, shape: &[u64], v: Vec<f32>) -> Self {
        Sample {
            f64s: v.iter().map(|&x| f64::from(x) + 1e-12).collect(),
            f32s: Vec::new(),
            ..Sample::f32(name, shape, "t d", None, Vec::new())
        }
    }
    pub(crate) fn i32(name: &'static str, shape: &[u64], dims: &'static str, v: Vec<i32>) -> Self {
        Sample {
            name,
            shape: shape.to_vec(),
            dims,
            rank: None,
            f32s: Vec::new(),
            f64s: Vec::new(),
            i32s: v,
        }
    }
    pub(crate) fn values(&self) -> Stage<'_> {
        if !self.i32s.is_empty() {
            Stage::I32(&self.i32s)
        } else if !self.f64s.is_empty() {
            Stage::F64(&self.f64s)
        } else {
            Stage::F32(&self.f32s)
        }
    }
}

/// A small two-layer run with tp = 2: f32, f64 and i32, whole and per-rank, NaN/Inf/±0, a
/// tensor larger than one statistics chunk, and one with no finite value.
pub(crate) fn samples() -> Vec<Sample> {
    let mut out = noise(32, 5, 3.0);
    out[1] = f32::NAN;
    out[2] = f32::INFINITY;
    out[3] = f32::NEG_INFINITY;
    out[4] = 0.0;
    out[5] = -0.0;
    vec![
        Sample::f32("embed", &[4, 8], "t d", None, noise(32, 1, 0.5)),
        Sample::f32("L0.attn_norm", &[4, 8], "t d", None, noise(32, 2, 1.0)),
        Sample::f32(
            "L0.attn.q",
            &[4, 2, 6],
            "t h(tp) d",
            Some(0),
            noise(48, 3, 2.0),
        ),
        Sample::f32(
            "L0.attn.q",
            &[4, 2, 6],
            "t h(tp) d",
            Some(1),
            noise(48, 4, 2.0),
        ),
        Sample::i32(
            "L0.attn.index_topk",
            &[4, 3],
            "t k",
            vec![0, -1, -1, 0, 1, -1, 2, 1, 0, 3, 2, 1],
        ),
        Sample::i32(
            "L0.moe.topk_ids",
            &[4, 2],
            "t k",
            vec![7, 3, 250, 9, 0, 1, 255, 128],
        ),
        Sample::f32("L0.out", &[4, 8], "t d", None, out),
        Sample::f32(
            "L1.attn.out",
            &[4, 8],
            "t d partial(tp)",
            Some(0),
            noise(32, 6, 1.0),
        ),
        Sample::f32(
            "L1.attn.out",
            &[4, 8],
            "t d partial(tp)",
            Some(1),
            noise(32, 7, 1.0),
        ),
        Sample::f64("L1.attn_resid", &[4, 8], noise(32, 10, 2.0)),
        // Past one piece of the content hash (1 MiB).
        Sample::f32(
            "L1.out",
            &[3, 100_000],
            "t d",
            None,
            noise(300_000, 8, 40.0),
        ),
        Sample::f32("final_norm", &[2, 2], "t d", None, vec![f32::NAN; 4]),
        Sample::f32("logits", &[4, 50], "t v(tp)", None, noise(200, 9, 12.0)),
    ]
}

/// Stages stored in full in the sample trace (the others keep stats only).
pub(crate) const FULL: [&str; 7] = [
    "logits",
    "L*.out",
    "L*.attn_resid",
    "embed",
    "final_norm",
    "L*.attn.q",
    "L*.attn.index_topk",
];

pub(crate) fn header() -> TraceHeader {
    TraceHeader {
        producer: json!({"tool": "trace_format test"})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        model: ModelInfo {
            source: "synthetic".into(),
            fingerprint: "00ff".into(),
            ..Default::default()
        },
        tokens: vec![1, 2, 3, 4],
        backend: "glmcheck".into(),
        dtype: "f32".into(),
        tp: 2,
    }
}

/// How a stage reaches the writer.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Give {
    /// Values copied by the writer.
    Copied,
    /// Values handed over.
    HandedOver,
    /// An f32 stage the trace keeps statistics of by its statistics alone, finished by the
    /// writing thread (as a GPU's are); every other stage copied.
    StatsAlone,
    /// Values handed over when the writing thread asks for them (as a GPU's copies arrive).
    Later,
}

/// Write the sample run into `dir` with `full` patterns.
pub(crate) fn write_trace(dir: &Path, full: &[&str]) {
    write_trace_as(dir, full, Give::Copied);
}

/// [`write_trace`], each stage given to the writer as `give` says.
pub(crate) fn write_trace_as(dir: &Path, full: &[&str], give: Give) {
    let selector = FullSelector::new(full).expect("valid globs");
    let mut w = TraceWriter::create(dir, header(), selector).expect("create trace");
    for s in samples() {
        let alone = give == Give::StatsAlone && w.takes_stats(s.name);
        match s.values() {
            Stage::F32(v) if alone => {
                let stats = TensorStats::of(v);
                let later: StatsLater = Box::new(move || Ok(stats));
                w.record_stats(s.name, &s.shape, s.dims, s.rank, v.len(), later)
            }
            values if give == Give::HandedOver || give == Give::Later => {
                let owned = match values {
                    Stage::I32(_) => OwnedStage::I32(s.i32s),
                    Stage::F64(_) => OwnedStage::F64(s.f64s.into()),
                    Stage::F32(_) => OwnedStage::F32(s.f32s.into()),
                };
                let len = s.shape.iter().product::<u64>() as usize;
                if give == Give::Later {
                    let later = Box::new(move || Ok(owned));
                    w.record_later(s.name, &s.shape, s.dims, s.rank, len, later)
                } else {
                    w.record_owned(s.name, &s.shape, s.dims, s.rank, owned)
                }
            }
            values => w.record(s.name, &s.shape, s.dims, s.rank, values),
        }
        .expect("record");
    }
    w.finish().expect("finish");
}

pub(crate) fn sample_trace(root: &Path) -> PathBuf {
    let dir = root.join("run.trace");
    write_trace(&dir, &FULL);
    dir
}

#[test]
fn oracle_recomputes_every_stat_and_hash() {
    let tmp = common::scratch();
    for (name, full) in [("mixed.trace", &FULL[..]), ("all.trace", &["**"][..])] {
        let dir = tmp.path().join(name);
        write_trace(&dir, full);
        let report: Value = serde_json::from_str(&common::run_oracle(
            "trace.check",
            &[dir.to_str().expect("UTF-8")],
        ))
        .expect("oracle prints JSON");
        let stored = if name == "all.trace" { 13 } else { 9 };
        assert_eq!(
            report,
            json!({"checked": stored, "stats_only": 13 - stored}),
            "{name}"
        );
    }
}

/// Every statistic read back equals the one written, bit for bit (serde_json parses floats
/// exactly with its `float_roundtrip` feature).
fn assert_same_stats(got: &TensorStats, want: &TensorStats, stage: &str) {
    let floats = |s: &TensorStats| [s.mean, s.std, s.min, s.max, s.absmax, s.l2].map(f64::to_bits);
    assert_eq!(floats(got), floats(want), "{stage}: {got:?} vs {want:?}");
    let exact = |s: &TensorStats| [s.count, s.nan, s.inf, s.zeros, s.hash];
    assert_eq!(exact(got), exact(want), "{stage}");
}

/// The JSON object `{length: result}` an oracle script prints for the given lengths.
fn oracle_by_length(script: &str, lengths: &[usize]) -> Value {
    let args: Vec<String> = lengths.iter().map(usize::to_string).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    serde_json::from_str(&common::run_oracle(script, &args)).unwrap()
}

/// glmcheck's content hash, the probe's (numpy) and the oracle's word-by-word reference agree
/// on lengths around a word, a row of lanes and a piece, past which pieces' hashes are hashed.
#[test]
fn the_content_hash_is_the_same_in_rust_the_probe_and_the_reference() {
    let piece = glmcheck::trace::stats::HASH_PIECE_BYTES;
    let row = 8 * glmcheck::trace::stats::HASH_LANES;
    let lengths = [
        0,
        1,
        7,
        8,
        9,
        row - 1,
        row,
        row + 5,
        piece - 8,
        piece,
        piece + 1,
        3 * piece + 13,
    ];
    let python = oracle_by_length("trace.lane_hash", &lengths);
    for n in lengths {
        let bytes: Vec<u8> = (0..n).map(|i| ((i * 31 + 7) % 251) as u8).collect();
        let ours = format!(
            "{:016x}",
            glmcheck::trace::stats::content_hash_of_bytes(&bytes)
        );
        assert_eq!(python[n.to_string()], json!(ours), "{n} bytes");
    }
}

/// glmcheck's moments and the probe's (numpy) agree bit for bit on lengths around a row of lanes
/// and a chunk, with NaN, infinities and signed zeros among the values.
#[test]
fn the_moments_are_the_same_in_rust_and_the_probe() {
    let (lanes, chunk) = (glmcheck::trace::stats::MOMENT_LANES, 1 << 16);
    let lengths = [
        0,
        1,
        lanes - 1,
        lanes,
        lanes + 3,
        chunk - 1,
        chunk,
        chunk + 1,
        3 * chunk + 21,
    ];
    let python = oracle_by_length("trace.moments", &lengths);
    // As the script makes them: its later assignments win.
    let special = [
        (1000, f32::NAN),
        (1777, f32::INFINITY),
        (2500, f32::NEG_INFINITY),
        (300, 0.0),
        (301, -0.0),
    ];
    for n in lengths {
        let xs: Vec<f32> = (0..n as i64)
            .map(
                |i| match special.iter().rfind(|(every, _)| i > 0 && i % every == 0) {
                    Some(&(_, v)) => v,
                    None => ((i * 7919) % 2001 - 1000) as f32 / 37.0,
                },
            )
            .collect();
        let ours = TensorStats::of(&xs);
        let theirs = &python[n.to_string()];
        let float = |k: &str| -> f64 { theirs[k].as_str().unwrap().parse().unwrap() };
        let count = |k: &str| theirs[k].as_u64().unwrap();
        assert_eq!(
            (ours.count, ours.nan, ours.inf, ours.zeros),
            (count("count"), count("nan"), count("inf"), count("zeros")),
            "{n} values: counts"
        );
        for (k, v) in [
            ("mean", ours.mean),
            ("std", ours.std),
            ("min", ours.min),
            ("max", ours.max),
            ("absmax", ours.absmax),
            ("l2", ours.l2),
        ] {
            assert_eq!(v.to_bits(), float(k).to_bits(), "{n} values: {k}");
        }
    }
}

#[test]
fn round_trip_keeps_every_bit() {
    let tmp = common::scratch();
    let trace = Trace::open(&sample_trace(tmp.path())).expect("open");
    let names: Vec<&str> = trace.stages().iter().map(|s| s.name.as_str()).collect();
    let written: Vec<&str> = samples().iter().map(|s| s.name).collect();
    assert_eq!(names, written, "stages in recording order");
    let selector = FullSelector::new(&FULL).expect("globs");
    for s in samples() {
        let record = trace.stage(s.name, s.rank).expect("stage recorded");
        let expected = match s.values() {
            Stage::F32(v) => TensorStats::of(v),
            Stage::F64(v) => TensorStats::of(v),
            Stage::I32(v) => TensorStats::of(v),
        };
        assert_same_stats(&record.stats, &expected, s.name);
        let f32s = trace.tensor(s.name, s.rank).expect("read");
        if !selector.matches(s.name) {
            assert_eq!(f32s, None, "{} keeps stats only", s.name);
            continue;
        }
        let f32s = f32s.expect("full tensor");
        if !s.f64s.is_empty() {
            let narrowed: Vec<f32> = s.f64s.iter().map(|&v| v as f32).collect();
            assert_eq!(f32s, narrowed, "{} read back narrowed to f32", s.name);
        } else if s.i32s.is_empty() {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&f32s), bits(&s.f32s), "{}", s.name);
        } else {
            assert_eq!(
                trace.tensor_i32(s.name, s.rank).expect("read"),
                Some(s.i32s.clone())
            );
            let as_f32: Vec<f32> = s.i32s.iter().map(|&v| v as f32).collect();
            assert_eq!(f32s, as_f32);
        }
    }
    let err = trace
        .tensor("L9.out", None)
        .expect_err("no such stage")
        .to_string();
    assert!(
        err.contains("\"L9.out\"") && err.contains("not in the trace"),
        "{err}"
    );
}

/// The error opening the sample trace after `edit` changed its manifest; it names the trace.
fn open_edited(edit: impl FnOnce(&mut Value)) -> String {
    let tmp = common::scratch();
    let dir = sample_trace(tmp.path());
    let path = dir.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&fs::read(&path).expect("read")).expect("JSON");
    edit(&mut m);
    fs::write(&path, serde_json::to_vec(&m).expect("JSON")).expect("write");
    let err = Trace::open(&dir).expect_err("must be refused").to_string();
    assert!(
        err.contains(&dir.display().to_string()),
        "does not name the trace: {err}"
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    err
}

/// The index of the `L0.out` record in the sample manifest.
const L0_OUT: usize = 6;

#[test]
fn broken_manifests_are_refused_naming_the_field() {
    for file in [
        "../outside.safetensors",
        "/etc/passwd",
        "L0/../../x.safetensors",
    ] {
        let err = open_edited(|m| m["stages"][L0_OUT]["file"] = json!(file));
        assert!(
            err.contains("stages[6] \"L0.out\" file") && err.contains(file),
            "{err}"
        );
    }
    let err = open_edited(|m| m["version"] = json!(3));
    assert!(err.contains("version: 3"), "{err}");
    let err = open_edited(|m| m["version"] = json!(1));
    assert!(
        err.contains("version: 1") && err.contains("older content hash"),
        "{err}"
    );
    let err = open_edited(|m| m["format"] = json!("other"));
    assert!(err.contains("format"), "{err}");
    let err = open_edited(|m| m["stages"][L0_OUT]["shape"] = json!([4, 9]));
    assert!(err.contains("\"L0.out\" shape"), "{err}");
    let err = open_edited(|m| m["stages"][2]["name"] = json!(""));
    assert!(err.contains("stages[2] name"), "{err}");
    let err = open_edited(|m| m["stages"][2]["rank"] = json!(2));
    assert!(err.contains("rank: 2 is not below tp = 2"), "{err}");
    let err = open_edited(|m| m["stages"][3]["rank"] = json!(0));
    assert!(err.contains("recorded twice"), "{err}");
    let err = open_edited(|m| m["stages"][L0_OUT]["stats"]["sketch"] = json!([1.0, 2.0]));
    assert!(
        err.contains("\"L0.out\" stats.sketch") && err.contains("2 buckets, not 32"),
        "{err}"
    );
    let err = open_edited(|m| m["stages"][L0_OUT]["stats"]["hash"] = json!(12));
    assert!(err.contains("stages[6]") && err.contains("string"), "{err}");
    let err = open_edited(|m| {
        m.as_object_mut().expect("object").remove("backend");
    });
    assert!(err.contains("backend"), "{err}");

    let tmp = common::scratch();
    let dir = sample_trace(tmp.path());
    fs::write(
        dir.join("manifest.json"),
        b"{\"format\": \"glmcheck-trace\",",
    )
    .expect("write");
    let err = Trace::open(&dir).expect_err("broken JSON").to_string();
    assert!(
        err.contains("manifest.json: broken JSON at line 1"),
        "{err}"
    );
}

#[test]
fn unknown_fields_are_kept() {
    let tmp = common::scratch();
    let dir = sample_trace(tmp.path());
    let path = dir.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&fs::read(&path).expect("read")).expect("JSON");
    m["engine"] = json!({"name": "vllm", "graph": "cuda"});
    m["stages"][L0_OUT]["probe_hook"] = json!("model.layers.0");
    fs::write(&path, serde_json::to_vec(&m).expect("JSON")).expect("write");
    let trace = Trace::open(&dir).expect("extra fields are fine");
    assert_eq!(trace.manifest().extra["engine"]["name"], "vllm");
    assert_eq!(trace.stages()[L0_OUT].extra["probe_hook"], "model.layers.0");
    let again: Value = serde_json::from_slice(&trace.manifest().to_json()).expect("JSON");
    assert_eq!(again, m, "written back unchanged");
}
