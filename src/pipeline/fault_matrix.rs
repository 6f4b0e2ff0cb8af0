//! The fault matrix (`glmcheck selftest --faults MODEL`): glmcheck's own diagnosis checked on a
//! backend. Every fault of the catalogue is planted in turn in a candidate run at the given TP
//! and dtypes, and `bisect` must name the catalogue's class at its stage; a clean candidate
//! must pass. On a GPU backend, a clean CPU candidate is also bisected against the reference
//! run on that backend (`bisect --reference-backend`), and must pass at f32's tolerance.

use anyhow::{bail, Result};

use super::bisect::{bisect, BisectOptions, Candidate, RunAs};
use super::Model;
use crate::any_backend::BackendKind;
use crate::compare::{DiffReport, Status};
use crate::dtype::Precision;
use crate::exec::faults::inject::{Injection, CATALOGUE};
use crate::model::stages::{stage_names, stage_weights};
use crate::report::selftest::{FaultCase, FaultMatrixReport};
use crate::weights::GgmlType;

/// The prompt of every case: 12 tokens, enough for the DSA top-k to choose.
const TOKENS: [u32; 12] = [39, 100, 7, 200, 5, 6, 7, 8, 9, 10, 11, 12];

/// What bisect's `diff` made of a case expecting `(class, stages)` (no class: a pass).
fn judged(
    fault: String,
    dtype: Precision,
    (expected_class, expected_stages): (Option<&'static str>, Vec<String>),
    diff: &DiffReport,
) -> FaultCase {
    let stage = diff.first_divergence.as_ref().map(|d| d.stage.clone());
    let class = diff.fault.as_ref().map(|f| f.class.name());
    let ok = match expected_class {
        None => diff.verdict == Status::Pass,
        Some(want) => {
            diff.verdict == Status::Fail
                && class == Some(want)
                && (expected_stages.is_empty()
                    || stage.as_ref().is_some_and(|s| expected_stages.contains(s)))
        }
    };
    FaultCase {
        class,
        dtype: dtype.name(),
        expected_class,
        expected_stages,
        fault,
        ok,
        stage,
        tolerance_to_pass: diff.tolerance_to_pass,
        verdict: diff.verdict,
    }
}

/// Every case's bisect options: the fixed prompt, nothing generated, the rest the defaults.
fn case_options(model: &std::path::Path) -> BisectOptions {
    BisectOptions {
        tokens: TOKENS.to_vec(),
        generate: 0,
        ..BisectOptions::new(model.to_path_buf())
    }
}

/// The first stage that reads a Q4_K weight, where a broken Q4_K dequantizer first shows.
fn first_q4k_stage(model: &std::path::Path) -> Result<(crate::model::Glm5Config, Option<String>)> {
    let opened = Model::open(model)?;
    let (src, cfg) = (opened.source(), opened.cfg);
    let first = stage_names(&cfg).into_iter().find(|s| {
        stage_weights(&cfg, s)
            .into_iter()
            .any(|id| src.storage_type(id) == Some(GgmlType::Q4_K))
    });
    Ok((cfg, first))
}

/// Every catalogue fault (those named in `only`, when it names any) that applies at `tp` and
/// one of `dtypes`, and a clean candidate per dtype (unless `only` names faults), bisected on
/// `backend`.
pub fn matrix(
    model: &std::path::Path,
    backend: BackendKind,
    tp: u64,
    dtypes: &[Precision],
    only: &[String],
    mut progress: impl FnMut(&str),
) -> Result<FaultMatrixReport> {
    if let Some(unknown) = only
        .iter()
        .find(|n| !CATALOGUE.iter().any(|e| e.name == n.as_str()))
    {
        bail!("--fault {unknown}: not in the catalogue (glmcheck bisect --list-faults)");
    }
    let (cfg, first_q4k) = first_q4k_stage(model)?;
    let mut cases = Vec::new();
    let mut planted: Vec<(Option<Injection>, Precision)> = if only.is_empty() {
        dtypes.iter().map(|&d| (None, d)).collect()
    } else {
        Vec::new()
    };
    for entry in CATALOGUE {
        let chosen = only.is_empty() || only.iter().any(|n| n == entry.name);
        if !chosen || (entry.needs_tp && tp < 2) {
            continue;
        }
        let fault = Injection::parse(entry.name)?;
        for &dtype in dtypes {
            let fits = entry.dtype.is_none_or(|d| d == dtype.name());
            if fits && fault.check(&cfg, tp as usize, dtype).is_ok() {
                planted.push((Some(fault), dtype));
            }
        }
    }
    for (fault, dtype) in planted {
        let name = fault.map_or("clean".to_string(), |f| f.spec());
        progress(&format!("{name} at {}", dtype.name()));
        let report = bisect(&BisectOptions {
            candidate: Candidate::Run(RunAs {
                tp,
                backend,
                dtype,
                inject: fault,
                ..RunAs::default()
            }),
            ..case_options(model)
        })?;
        let expected = match fault {
            Some(f) => (
                Some(f.entry().class.name()),
                f.expected_stages(&cfg, first_q4k.as_deref()),
            ),
            None => (None, Vec::new()),
        };
        cases.push(judged(name, dtype, expected, &report.diff));
    }
    // The backend as the reference: a clean CPU candidate at f32 must agree with it within the
    // f32 tolerance, as the CPU reference agrees with itself.
    if backend != BackendKind::Cpu && only.is_empty() {
        let name = format!("clean, reference on {}", backend.name());
        progress(&name);
        let report = bisect(&BisectOptions {
            candidate: Candidate::Run(RunAs {
                tp,
                ..RunAs::default()
            }),
            reference_backend: backend,
            ..case_options(model)
        })?;
        cases.push(judged(
            name,
            Precision::F32,
            (None, Vec::new()),
            &report.diff,
        ));
    }
    Ok(FaultMatrixReport {
        backend: backend.name(),
        missed: cases.iter().filter(|c| !c.ok).count(),
        cases,
        tp,
        model: model.to_path_buf(),
    })
}
