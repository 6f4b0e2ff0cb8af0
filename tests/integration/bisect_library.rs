//! bisect driven in-process through the library (`glmcheck::pipeline::bisect`), as another
//! tool would embed it: a planted fault is found at the stage and with the class the catalogue
//! gives, the report's evidence names the weight, and a clean candidate at TP 2 passes.

use crate::common;

use glmcheck::compare::Status;
use glmcheck::exec::faults::inject::Injection;
use glmcheck::model::names::LayerWeight;
use glmcheck::pipeline::bisect::{bisect, BisectOptions, Candidate, RunAs};

const TOKENS: [u32; 6] = [39, 100, 7, 200, 5, 6];

fn options(model: std::path::PathBuf, tp: u64, inject: Option<Injection>) -> BisectOptions {
    BisectOptions {
        candidate: Candidate::Run(RunAs {
            tp,
            inject,
            ..RunAs::default()
        }),
        tokens: TOKENS.to_vec(),
        generate: 0,
        ..BisectOptions::new(model)
    }
}

#[test]
fn a_planted_fault_is_named_in_process() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    common::synth_tiny(&model, &[]);
    let fault = Injection::UnshardedColumn(LayerWeight::KvB);
    let report = bisect(&options(model.clone(), 4, Some(fault))).expect("bisect runs");

    let diff = &report.diff;
    assert_eq!(diff.verdict, Status::Fail);
    let cfg = common::weight_source(&model).cfg;
    let stage = &diff.first_divergence.as_ref().expect("a divergence").stage;
    assert!(
        fault.expected_stages(&cfg, None).contains(stage),
        "first divergence at {stage}"
    );
    let found = diff.fault.as_ref().expect("a fault");
    assert_eq!(found.class, fault.entry().class);
    assert_eq!(report.bisect.classified_by, "drill-down");
    assert!(
        found.weight.as_deref().is_some_and(|w| w.contains("kv_b")),
        "the weight named: {:?}",
        found.weight
    );
    assert_eq!(report.bisect.tp, 4);
    assert_eq!(report.bisect.inject.as_deref(), Some(fault.spec().as_str()));
}

#[test]
fn a_clean_candidate_passes_in_process() {
    let dir = common::scratch();
    let model = dir.path().join("tiny.gguf");
    common::synth_tiny(&model, &[]);
    let report = bisect(&options(model, 2, None)).expect("bisect runs");
    assert_eq!(report.diff.verdict, Status::Pass);
    assert!(report.diff.fault.is_none());
    assert!(report.diff.first_divergence.is_none());
    assert!(
        report.diff.tolerance_to_pass < 1e-5,
        "TP 2 in f32 against TP 1: {}",
        report.diff.tolerance_to_pass
    );
}
