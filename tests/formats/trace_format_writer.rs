//! The trace writer's other ways in: statistics finished later, values arriving on the writing
//! thread, values handed over, any thread count, layer by layer as a run goes (a crash leaves the
//! finished layers), and its refusals; all of them write what the sample trace of `trace_format`
//! does or name the stage.

use crate::common;
use crate::trace_format::{header, noise, samples, write_trace, write_trace_as, Give, FULL};

use std::fs;
use std::path::Path;

use glmcheck::trace::stats::StatsLater;
use glmcheck::trace::{
    FullSelector, OwnedStage, Stage, StageLater, TensorStats, Trace, TraceWriter,
};

/// The files of a trace folder, sorted.
fn listing(d: &Path) -> Vec<std::ffi::OsString> {
    let mut names: Vec<_> = fs::read_dir(d)
        .expect("list")
        .map(|e| e.expect("entry").file_name())
        .collect();
    names.sort();
    names
}

/// Two trace folders hold the same files, byte for byte.
fn assert_same_files(a: &Path, b: &Path) {
    assert_eq!(listing(a), listing(b));
    for name in listing(a) {
        assert!(
            fs::read(a.join(&name)).expect("read") == fs::read(b.join(&name)).expect("read"),
            "{name:?} differs"
        );
    }
}

/// Stages recorded by statistics finished later (what a GPU takes) write the trace that their
/// values do (which `oracle_recomputes_every_stat_and_hash` checks against numpy); a stage the
/// trace stores whole cannot be recorded so, and statistics that fail to finish fail the trace
/// naming the stage.
#[test]
fn statistics_finished_later_write_what_the_values_do() {
    let tmp = common::scratch();
    let (a, b) = (tmp.path().join("a.trace"), tmp.path().join("b.trace"));
    write_trace(&a, &FULL);
    write_trace_as(&b, &FULL, Give::StatsAlone);
    assert_same_files(&a, &b);

    let selector = FullSelector::new(&["L0.out"]).expect("valid globs");
    let mut w = TraceWriter::create(&tmp.path().join("c.trace"), header(), selector).unwrap();
    assert!(!w.takes_stats("L0.out") && w.takes_stats("L0.attn_norm"));
    let done = || -> StatsLater { Box::new(|| Ok(TensorStats::of(&[1.0f32, 2.0]))) };
    let err = w
        .record_stats("L0.out", &[1, 2], "t d", None, 2, done())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"L0.out\"") && err.contains("stored whole"),
        "{err}"
    );
    let err = w
        .record_stats("L0.attn_norm", &[1, 3], "t d", None, 2, done())
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not hold 2 values"), "{err}");
    let lost: StatsLater = Box::new(|| anyhow::bail!("device lost"));
    w.record_stats("L0.attn_norm", &[1, 2], "t d", None, 2, lost)
        .unwrap();
    let err = w.finish().unwrap_err().to_string();
    assert!(
        err.contains("\"L0.attn_norm\" statistics") && err.contains("device lost"),
        "{err}"
    );
}

/// Values that arrive on the writing thread (a GPU's copies, a ranking on its own thread) write
/// what the same values recorded at once do, stored or not; values that fail to arrive, or
/// arrive in another number, fail the trace naming the stage.
#[test]
fn values_arriving_later_write_what_the_values_do() {
    let tmp = common::scratch();
    let (a, b) = (tmp.path().join("a.trace"), tmp.path().join("b.trace"));
    write_trace(&a, &FULL);
    write_trace_as(&b, &FULL, Give::Later);
    assert_same_files(&a, &b);

    let failing = |dir: &str, name: &str, later: StageLater| {
        let selector = FullSelector::new(&["L0.out"]).expect("valid globs");
        let mut w = TraceWriter::create(&tmp.path().join(dir), header(), selector).unwrap();
        w.record_later(name, &[1, 2], "t d", None, 2, later)
            .unwrap();
        w.finish().unwrap_err().to_string()
    };
    let err = failing(
        "c.trace",
        "L0.out",
        Box::new(|| anyhow::bail!("device lost")),
    );
    assert!(
        err.contains("\"L0.out\" values") && err.contains("device lost"),
        "{err}"
    );
    let three = || Ok(OwnedStage::F32(vec![1.0f32, 2.0, 3.0].into()));
    let err = failing("d.trace", "L0.attn_norm", Box::new(three));
    assert!(
        err.contains("\"L0.attn_norm\" values")
            && err.contains("3 values arrived for shape [1, 2]"),
        "{err}"
    );
}

#[test]
fn writing_is_deterministic_and_handing_values_over_writes_what_copying_does() {
    let tmp = common::scratch();
    let (a, b) = (tmp.path().join("a.trace"), tmp.path().join("b.trace"));
    write_trace(&a, &FULL);
    write_trace_as(&b, &FULL, Give::HandedOver);
    assert_same_files(&a, &b);
    let files: Vec<_> = listing(&a)
        .into_iter()
        .map(|n| n.into_string().expect("UTF-8"))
        .collect();
    assert_eq!(
        files,
        [
            "L0.safetensors",
            "L1.safetensors",
            "embed.safetensors",
            "final_norm.safetensors",
            "logits.safetensors",
            "manifest.json"
        ]
    );
}

#[test]
fn stats_do_not_depend_on_thread_count() {
    let xs = noise(1 << 20, 11, 100.0);
    let on = |threads| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        pool.install(|| TensorStats::of(&xs))
    };
    let one = on(1);
    assert_eq!(one, on(2));
    assert_eq!(one, on(7));
    let json = serde_json::to_value(&one).expect("serialize");
    let hash = json["hash"].as_str().expect("hash is a string");
    assert_eq!(hash.len(), 16);
    assert_eq!(
        serde_json::from_value::<TensorStats>(json).expect("deserialize"),
        one
    );
}

#[test]
fn a_crashed_run_leaves_its_finished_layers() {
    let tmp = common::scratch();
    let dir = tmp.path().join("crash.trace");
    let mut w = TraceWriter::create(&dir, header(), FullSelector::default()).expect("create");
    for s in samples().iter().take_while(|s| s.name != "L1.out") {
        w.record(s.name, &s.shape, s.dims, s.rank, s.values())
            .expect("record");
    }
    drop(w);
    let trace = Trace::open(&dir).expect("readable after a crash");
    assert!(!trace.manifest().complete, "marked partial");
    assert_eq!(
        trace.stage_names(),
        [
            "embed",
            "L0.attn_norm",
            "L0.attn.q",
            "L0.attn.index_topk",
            "L0.moe.topk_ids",
            "L0.out"
        ]
    );
    assert!(trace.tensor("L0.out", None).expect("read").is_some());
    assert_eq!(
        trace.tensor("embed", None).expect("read"),
        None,
        "not selected by default"
    );
    assert!(!dir.join("L1.safetensors").exists());
}

/// What a run learns about itself (each layer's seconds, added up; other producer entries)
/// reaches the manifest with the next layer written, and at the end when nothing follows.
#[test]
fn producer_facts_travel_with_the_layers() {
    let tmp = common::scratch();
    let dir = tmp.path().join("facts.trace");
    let mut w = TraceWriter::create(&dir, header(), FullSelector::default()).expect("create");
    let v = [1f32; 8];
    w.record("L0.out", &[2, 4], "t d", None, Stage::F32(&v))
        .expect("record");
    w.add_layer_seconds("L0", 0.25);
    w.add_layer_seconds("L0", 0.5);
    w.add_layer_seconds("L0.ffn", 0.125);
    // The next layer's first stage hands L0 and its facts to the writing thread.
    w.record("L1.out", &[2, 4], "t d", None, Stage::F32(&v))
        .expect("record");
    w.add_layer_seconds("L1", 1.0);
    w.set_producer("gpu_peak_bytes", serde_json::json!([7]));
    let manifest = w.finish().expect("finish");
    let producer = &manifest.producer;
    assert_eq!(producer["layer_seconds"]["L0"], 0.75);
    assert_eq!(producer["layer_seconds"]["L0.ffn"], 0.125);
    assert_eq!(producer["layer_seconds"]["L1"], 1.0);
    assert_eq!(producer["gpu_peak_bytes"], serde_json::json!([7]));
    // And on disk, as a reader sees it.
    let trace = Trace::open(&dir).expect("open");
    assert_eq!(trace.manifest().producer["layer_seconds"]["L1"], 1.0);
    assert_eq!(trace.stage_names(), ["L0.out", "L1.out"]);
}

/// Groups are written on a thread of their own; an error there (the folder gone) still
/// reaches the run, by the next record or at the end, naming the file.
#[test]
fn a_failed_write_reaches_the_run() {
    let tmp = common::scratch();
    let dir = tmp.path().join("gone.trace");
    let mut w = TraceWriter::create(&dir, header(), FullSelector::default()).expect("create");
    let v = [1f32; 8];
    w.record("L0.out", &[2, 4], "t d", None, Stage::F32(&v))
        .expect("record");
    fs::remove_dir_all(&dir).expect("remove the folder");
    let later = w.record("L1.out", &[2, 4], "t d", None, Stage::F32(&v));
    let err = match later {
        Err(e) => e,
        Ok(()) => w.finish().expect_err("the group could not be written"),
    };
    let text = err.to_string();
    assert!(
        text.contains("gone.trace") && text.contains("L0.safetensors"),
        "{text}"
    );
}

#[test]
fn the_writer_refuses_misuse() {
    let tmp = common::scratch();
    let dir = tmp.path().join("w.trace");
    let mut w = TraceWriter::create(&dir, header(), FullSelector::default()).expect("create");
    let v = [0f32; 8];
    let mut err = |name: &str, shape: &[u64], rank| {
        w.record(name, shape, "t d", rank, Stage::F32(&v))
            .err()
            .map(|e| e.to_string())
    };
    assert_eq!(err("L0.out", &[2, 4], None), None);
    assert!(err("L0.x", &[3, 4], None)
        .expect("refused")
        .contains("\"L0.x\" shape"));
    assert!(err("L0.x", &[2, 4], Some(2))
        .expect("refused")
        .contains("rank"));
    assert!(err("L0.out", &[2, 4], None)
        .expect("refused")
        .contains("recorded twice"));
    assert!(err("", &[2, 4], None).expect("refused").contains("name"));
    assert!(err("../L0", &[2, 4], None)
        .expect("refused")
        .contains("name"));
    assert_eq!(err("L1.out", &[2, 4], None), None);
    assert!(err("L0.late", &[2, 4], None)
        .expect("refused")
        .contains("already written"));
    let again = TraceWriter::create(&dir, header(), FullSelector::default());
    assert!(again
        .err()
        .expect("folder in use")
        .to_string()
        .contains("already holds files"));
}

#[test]
fn full_patterns_match_name_parts() {
    let default = FullSelector::default();
    for (name, want) in [
        ("L3.out", true),
        ("L77.out", true),
        ("logits", true),
        ("L3.attn.out", false),
        ("L3.ffn_norm", false),
        ("embed", false),
    ] {
        assert_eq!(default.matches(name), want, "{name}");
    }
    let all = FullSelector::new(&["**"]).expect("glob");
    assert!(all.matches("L3.attn.out") && all.matches("embed"));
    let attn = FullSelector::new(&["L*.attn.*"]).expect("glob");
    assert!(attn.matches("L3.attn.q") && !attn.matches("L3.out"));
    let err = FullSelector::new(&["L[3"]).expect_err("bad glob");
    assert!(err.to_string().contains("`L[3`"), "{err}");
}
