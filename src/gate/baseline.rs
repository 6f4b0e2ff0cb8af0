//! The baseline file of `glmcheck gate`: what an accepted run looked like, stage by stage, and how
//! far a candidate may depart from it.
//!
//! A baseline keeps, for every stage record of the run it was made from (whole or one rank's
//! part, in the trace's order), the statistics the trace keeps ([`TensorStats`]: count, mean,
//! std, min, max, absmax, l2, NaN/Inf/zero counts, content hash), and for the logits the top-1
//! token, its margin, the entropy and the largest |logit| of every position. Full tensors are
//! not kept: a baseline of a 78-layer run stays a few hundred lines that a reviewer can read.
//!
//! The file is JSON written for review: fixed key order, one line per stage, so that a change
//! of the baseline shows in a diff as the stages it moved.
//!
//! # Limits
//!
//! A candidate passes a stage when every statistic stays within `ε` of the baseline's, on the
//! scale that statistic can move by when every value moves by at most `ε` of the stage's own
//! size: `l2` by `ε·l2`, `mean` and `std` by `ε·rms`, `min`, `max` and `absmax` by
//! `ε·absmax`. `ε = roundings × u`, with `u` the unit roundoff of the run's dtype (see
//! [`unit_roundoff`] and [`roundings`]). NaN and Inf counts must not grow; zeros may grow by
//! `max(1, ε·count)` (exact cancellations); top-k ids must be the same sets unless the
//! baseline's own boundary gap is a near tie (smaller than `ε` of the layer's largest gap).

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::compare::stage_diff::whole_values;
use crate::dtype::Precision;
use crate::exec::ops::ties::TieBreaks;
use crate::model::stage::{is_gaps, kind_of, layer_of, Stage};
use crate::trace::{ElemType, TensorStats, Trace};

/// The `format` of every baseline file.
pub const FORMAT: &str = "glmcheck-baseline";
/// The baseline version this crate reads and writes.
pub const VERSION: u64 = 1;

/// The unit roundoff of a run's dtype: half the distance from 1 to the next number.
pub fn unit_roundoff(dtype: &str) -> Option<f64> {
    Precision::from_name(dtype)
        .ok()
        .map(Precision::unit_roundoff)
}

/// How many roundings of the dtype a one-ulp-level change may add up to at a stage.
///
/// * f32 and f64: every add of a long dot product rounds, and errors travel through the layers;
///   the f32 reference's own rounding (an f64 run of the same model, rounded to f32) moves a
///   statistic of the 6-layer `small` preset by up to 39 u, a different summation order (TP 2
///   or 4 against TP 1) by up to 29 u. 64 leaves room for deeper models and is still ~6000×
///   below the smallest departure a catalogue fault makes in f32 (3.7·10⁵ u).
/// * bf16 and f16 (GPU engines: f32 accumulation, each op's output rounded once): an f32-level
///   difference changes a result only where it flips a rounding, by one ulp of that value; a
///   candidate with every value one ulp off moves a statistic by at most 2 u. 16 allows a few
///   such flips to compound while the faults' first divergent stages depart by 18–768 u.
pub fn roundings(dtype: &str) -> f64 {
    match dtype {
        "bf16" | "f16" => 16.0,
        _ => 64.0,
    }
}

/// The whole baseline file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Baseline {
    pub format: String,
    pub version: u64,
    /// Who made the baseline and from what (tool, version, the candidate it was made from, that
    /// run's producer fields).
    #[serde(default)]
    pub producer: Map<String, Value>,
    pub model: BaselineModel,
    /// What computed the values (`cpu`, an engine's name).
    pub backend: String,
    /// The run's dtype (`f32`, `bf16`…): candidates must match it.
    pub dtype: String,
    /// Tensor-parallel degree: candidates must match it.
    pub tp: u32,
    /// Expert parallelism (the per-rank routed parts depend on it).
    #[serde(default)]
    pub ep: bool,
    /// The prompt's token ids: candidates must match them.
    pub tokens: Vec<u32>,
    pub limits: Limits,
    /// In the trace's order.
    pub stages: Vec<StageBaseline>,
    /// Per-position logits statistics; absent when the run did not keep the logits' values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logits: Option<LogitsBaseline>,
}

/// The model the baseline's run used.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BaselineModel {
    /// Where the weights were read from (informative only).
    pub source: String,
    /// The trace's digest of the weights' names, types and shapes: candidates must match it.
    pub fingerprint: String,
}

/// The rule the limits follow (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// The dtype's unit roundoff u.
    pub unit_roundoff: f64,
    /// How many roundings a stage may move by.
    pub roundings: f64,
    /// `roundings × unit_roundoff`: each stage's ε unless the stage sets its own.
    pub epsilon: f64,
}

impl Limits {
    /// The rule for `dtype`, or None for a dtype without a known unit roundoff.
    pub fn for_dtype(dtype: &str) -> Option<Limits> {
        let u = unit_roundoff(dtype)?;
        let k = roundings(dtype);
        Some(Limits {
            unit_roundoff: u,
            roundings: k,
            epsilon: k * u,
        })
    }
}

/// One stage record of the baseline's run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageBaseline {
    pub name: String,
    /// The tensor-parallel rank whose part this is; absent for the whole tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    pub shape: Vec<u64>,
    pub dtype: ElemType,
    pub dims: String,
    pub stats: TensorStats,
    /// For top-k id stages: the smallest gap at the top-k boundary over the layer's largest,
    /// when the run kept the gaps (`L{n}.attn.index_gap`, `L{n}.moe.topk_gap`). At or below ε
    /// the choice is a near tie that a one-ulp change may break the other way: the stage is
    /// then not judged (later stages judge its effect).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_gap_ratio: Option<f64>,
    /// For top-k id stages: `[position, ids]` wherever the baseline's boundary gap there was a
    /// near tie (at most ε of the layer's largest). A candidate run by the gate takes these
    /// choices at exactly these positions, so that a tie another CPU's summation order breaks
    /// the other way does not move every later stage; elsewhere its own choice is judged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub near_ties: Vec<(usize, Vec<i32>)>,
    /// This stage's own ε, replacing `limits.epsilon` (set by hand in review, with a reason in
    /// the commit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon: Option<f64>,
}

impl StageBaseline {
    /// `L0.attn.q @1` or `L0.out`.
    pub fn label(&self) -> String {
        match self.rank {
            Some(r) => format!("{} @{r}", self.name),
            None => self.name.clone(),
        }
    }

    /// Whether a change of the ids is judged (not a near tie of the baseline's run).
    pub fn ids_judged(&self, epsilon: f64) -> bool {
        self.min_gap_ratio.is_none_or(|r| r > epsilon)
    }
}

/// The logits of every prompt position.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogitsBaseline {
    pub positions: usize,
    pub vocab: usize,
    /// Mean entropy over the positions; ln V would be a uniform distribution.
    pub entropy_mean: f64,
    /// Mean entropy at least 90% of ln V: the baseline itself carries no information.
    pub flat: bool,
    /// Per position: the top-1 token id.
    pub top1: Vec<u32>,
    /// Per position: the top-1 logit minus the second.
    pub margin: Vec<f64>,
    /// Per position: the entropy of the softmax (nats).
    pub entropy: Vec<f64>,
    /// Per position: the largest |logit| (the scale ε applies to).
    pub absmax: Vec<f64>,
}

/// Per-position statistics of `[positions, vocab]` logits (non-finite values ignored; a row
/// without a finite value has top-1 0 and entropy NaN, which no limit passes).
pub fn logits_rows(values: &[f32], vocab: usize) -> LogitsBaseline {
    let rows: Vec<&[f32]> = values.chunks_exact(vocab.max(1)).collect();
    let (mut top1, mut margin, mut entropy, mut absmax) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for row in &rows {
        let finite = || row.iter().map(|&v| f64::from(v)).filter(|v| v.is_finite());
        let (mut best, mut first, mut second) = (0usize, f64::NEG_INFINITY, f64::NEG_INFINITY);
        for (i, &v) in row.iter().enumerate() {
            let v = f64::from(v);
            if !v.is_finite() {
                continue;
            }
            if v > first {
                (second, first, best) = (first, v, i);
            } else if v > second {
                second = v;
            }
        }
        let sum: f64 = finite().map(|v| (v - first).exp()).sum();
        let h = -finite()
            .map(|v| {
                let p = (v - first).exp() / sum;
                if p > 0.0 {
                    p * p.ln()
                } else {
                    0.0
                }
            })
            .sum::<f64>();
        top1.push(best as u32);
        margin.push(if second.is_finite() {
            first - second
        } else {
            0.0
        });
        entropy.push(h);
        absmax.push(finite().map(f64::abs).fold(0.0, f64::max));
    }
    let n = rows.len().max(1) as f64;
    let entropy_mean = entropy.iter().sum::<f64>() / n;
    LogitsBaseline {
        positions: rows.len(),
        vocab,
        entropy_mean,
        flat: entropy_mean >= 0.9 * (vocab.max(1) as f64).ln(),
        top1,
        margin,
        entropy,
        absmax,
    }
}

/// The smallest non-negative gap of a gap stage over its largest, from its values when the
/// trace kept them, else from its statistics when they hold no "none" sentinel (−1).
fn gap_ratio(trace: &Trace, gap_stage: &str) -> Result<Option<f64>> {
    let Some(record) = trace.stage(gap_stage, None) else {
        return Ok(None);
    };
    let (lo, hi) = match whole_values(trace, gap_stage)? {
        Some((values, _)) => {
            let gaps = values.iter().map(|&g| f64::from(g)).filter(|g| *g >= 0.0);
            gaps.fold((f64::INFINITY, 0f64), |(lo, hi), g| (lo.min(g), hi.max(g)))
        }
        None if record.stats.min >= 0.0 => (record.stats.min, record.stats.max),
        None => return Ok(None),
    };
    Ok((lo.is_finite() && hi > 0.0).then(|| lo / hi))
}

/// `[position, ids]` of the ids stage `ids_stage` wherever its boundary gap is at most
/// `epsilon` of the layer's largest, when the trace kept both in full.
fn near_tie_choices(
    trace: &Trace,
    ids_stage: &str,
    gap_stage: &str,
    epsilon: f64,
) -> Result<Vec<(usize, Vec<i32>)>> {
    let (Some((ids, shape)), Some((gaps, _))) = (
        whole_values(trace, ids_stage)?,
        whole_values(trace, gap_stage)?,
    ) else {
        return Ok(Vec::new());
    };
    let k = shape.last().copied().unwrap_or(1).max(1) as usize;
    let largest = f64::from(gaps.iter().copied().fold(0f32, f32::max));
    Ok(gaps
        .iter()
        .zip(ids.chunks(k))
        .enumerate()
        .filter(|(_, (&g, _))| g >= 0.0 && f64::from(g) <= epsilon * largest)
        .map(|(p, (_, row))| (p, row.iter().map(|&v| v as i32).collect()))
        .collect())
}

impl Baseline {
    /// The baseline's choices at its near ties, for a candidate run to take.
    pub fn tie_breaks(&self) -> TieBreaks {
        let mut ties = TieBreaks::default();
        for s in self.stages.iter().filter(|s| !s.near_ties.is_empty()) {
            let Some(layer) = layer_of(&s.name) else {
                continue;
            };
            let map = if kind_of(&s.name) == Some("attn.index_topk") {
                &mut ties.dsa
            } else {
                &mut ties.moe
            };
            let positions = s.near_ties.iter().map(|(p, _)| p + 1).max().unwrap_or(0);
            let mut at = vec![None; positions];
            for (p, ids) in &s.near_ties {
                at[*p] = Some(ids.clone());
            }
            map.insert(layer, at);
        }
        ties
    }

    /// A baseline of `trace`; `from` says what it was made from (the candidate's path).
    pub fn from_trace(trace: &Trace, from: &str) -> Result<Baseline> {
        let m = trace.manifest();
        if !m.complete {
            bail!(
                "{}: complete: false: a partial trace (its run did not finish) cannot be a baseline",
                trace.dir().display()
            );
        }
        let Some(limits) = Limits::for_dtype(&m.dtype) else {
            bail!(
                "{}: dtype `{}` has no known unit roundoff (f64, f32, bf16, f16)",
                trace.dir().display(),
                m.dtype
            );
        };
        let mut stages = Vec::new();
        for s in trace.stages() {
            // Boundary gaps explain near ties; they are not outputs to judge.
            if is_gaps(&s.name) {
                continue;
            }
            let gap_stage = Stage::parse(&s.name)
                .and_then(|stage| stage.gaps())
                .map(|g| g.to_string());
            let (min_gap_ratio, near_ties) = match (&gap_stage, s.rank) {
                (Some(g), None) => (
                    gap_ratio(trace, g)?,
                    near_tie_choices(trace, &s.name, g, limits.epsilon)?,
                ),
                _ => (None, Vec::new()),
            };
            stages.push(StageBaseline {
                name: s.name.clone(),
                rank: s.rank,
                shape: s.shape.clone(),
                dtype: s.dtype,
                dims: s.dims.clone(),
                stats: s.stats.clone(),
                min_gap_ratio,
                near_ties,
                epsilon: None,
            });
        }
        let logits = match trace
            .stage("logits", None)
            .or_else(|| trace.stages().iter().find(|s| s.name == "logits"))
        {
            Some(_) => whole_values(trace, "logits")?.map(|(values, shape)| {
                let vocab = shape.last().copied().unwrap_or(1) as usize;
                logits_rows(&values, vocab)
            }),
            None => None,
        };
        const MEASURED: [&str; 8] = [
            "layer_seconds",
            "op_seconds",
            "pass_seconds",
            "gpu_peak_bytes",
            "gpu_resident_bytes",
            "gpu_kept_weight_bytes",
            "gpu_loaded_bytes",
            "gpu_load_seconds",
        ];
        let mut producer = Map::new();
        producer.insert("name".into(), "glmcheck".into());
        producer.insert("version".into(), env!("CARGO_PKG_VERSION").into());
        producer.insert("from".into(), from.into());
        // What the run measured about itself (wall times, GPU memory) differs from run to run:
        // a baseline keeps only how the run was made.
        let mut run = m.producer.clone();
        run.retain(|k, _| !MEASURED.contains(&k.as_str()));
        producer.insert("run".into(), Value::Object(run));
        Ok(Baseline {
            format: FORMAT.into(),
            version: VERSION,
            producer,
            model: BaselineModel {
                source: m.model.source.clone(),
                fingerprint: m.model.fingerprint.clone(),
            },
            backend: m.backend.clone(),
            dtype: m.dtype.clone(),
            tp: m.tp,
            ep: run_ep(&m.producer),
            tokens: m.tokens.clone(),
            limits,
            stages,
            logits,
        })
    }

    /// The ε of stage record `s`.
    pub fn epsilon(&self, s: &StageBaseline) -> f64 {
        s.epsilon.unwrap_or(self.limits.epsilon)
    }

    /// The run's `latent_norm_eps` as the producer of the baseline's run recorded it.
    pub fn latent_norm_eps(&self) -> Option<f64> {
        self.producer
            .get("run")
            .and_then(|r| r.get("latent_norm_eps"))
            .and_then(Value::as_f64)
    }

    /// Read and check the baseline at `path`; errors name the file and the field.
    pub fn load(path: &Path) -> Result<Baseline> {
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
                "{}: no such baseline (write one from an accepted run with --update)",
                path.display()
            ),
            Err(e) => return Err(e).with_context(|| path.display().to_string()),
        };
        Baseline::parse(&text).with_context(|| path.display().to_string())
    }

    /// Parse and check a baseline's text; errors name the field.
    pub fn parse(text: &[u8]) -> Result<Baseline> {
        let mut value: Value = serde_json::from_slice(text).map_err(|e| {
            anyhow::anyhow!(
                "broken JSON at line {} column {}: {e}",
                e.line(),
                e.column()
            )
        })?;
        let Some(top) = value.as_object_mut() else {
            bail!("not a JSON object");
        };
        match top.get("format") {
            Some(Value::String(f)) if f == FORMAT => {}
            other => bail!(
                "format: {}, expected \"{FORMAT}\"",
                other.map_or("missing".into(), Value::to_string)
            ),
        }
        match top.get("version").and_then(Value::as_u64) {
            Some(VERSION) => {}
            _ => bail!(
                "version: {}, this glmcheck reads {VERSION}",
                top.get("version")
                    .map_or("missing".into(), Value::to_string)
            ),
        }
        let stages = match top.remove("stages") {
            Some(Value::Array(s)) => s,
            Some(_) => bail!("stages: not an array"),
            None => bail!("stages: missing"),
        };
        let logits = top.remove("logits");
        top.insert("stages".into(), Value::Array(Vec::new()));
        let mut baseline: Baseline = serde_json::from_value(value)
            .map_err(|e| anyhow::anyhow!("{}", e.to_string().replace(" at line 0 column 0", "")))?;
        for (i, s) in stages.into_iter().enumerate() {
            let name = s
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string();
            let record: StageBaseline = serde_json::from_value(s)
                .map_err(|e| anyhow::anyhow!("stages[{i}] \"{name}\": {e}"))?;
            baseline.stages.push(record);
        }
        if let Some(l) = logits {
            baseline.logits =
                Some(serde_json::from_value(l).map_err(|e| anyhow::anyhow!("logits: {e}"))?);
        }
        baseline.check()?;
        Ok(baseline)
    }

    /// The rules the gate relies on: a known dtype, sane limits, statistics that describe a
    /// tensor of the stage's shape, ranks below tp, each record once, logits arrays per position.
    pub fn check(&self) -> Result<()> {
        if unit_roundoff(&self.dtype).is_none() {
            bail!("dtype: `{}` is not one of f64, f32, bf16, f16", self.dtype);
        }
        if self.tp == 0 {
            bail!("tp: 0, expected at least 1");
        }
        if self.tokens.is_empty() {
            bail!("tokens: empty");
        }
        let eps_ok = |e: f64| e.is_finite() && e > 0.0 && e < 1.0;
        if !eps_ok(self.limits.epsilon) {
            bail!(
                "limits.epsilon: {}, expected 0 < ε < 1",
                self.limits.epsilon
            );
        }
        let mut seen = HashSet::new();
        for (i, s) in self.stages.iter().enumerate() {
            let at = |field: &str| format!("stages[{i}] \"{}\" {field}", s.name);
            if s.name.is_empty() {
                bail!("stages[{i}] name: empty");
            }
            if !seen.insert((s.name.as_str(), s.rank)) {
                bail!("{}: recorded twice", at("name"));
            }
            if let Some(r) = s.rank.filter(|&r| r >= self.tp) {
                bail!("{}: {r} is not below tp = {}", at("rank"), self.tp);
            }
            let numel = s.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
            if numel != Some(s.stats.count) {
                bail!(
                    "{}: {:?} does not hold stats.count = {}",
                    at("shape"),
                    s.shape,
                    s.stats.count
                );
            }
            let t = &s.stats;
            if t.nan.checked_add(t.inf).is_none_or(|n| n > t.count) || t.zeros > t.count {
                bail!(
                    "{}: nan {} + inf {} (zeros {}) exceed count {}",
                    at("stats"),
                    t.nan,
                    t.inf,
                    t.zeros,
                    t.count
                );
            }
            for (field, v) in [("std", t.std), ("absmax", t.absmax), ("l2", t.l2)] {
                if v < 0.0 {
                    bail!("{}: {v} is negative", at(&format!("stats.{field}")));
                }
            }
            if t.min > t.max || t.absmax < t.min.abs().max(t.max.abs()) * (1.0 - 1e-12) {
                bail!(
                    "{}: min {} / max {} / absmax {} do not fit together",
                    at("stats"),
                    t.min,
                    t.max,
                    t.absmax
                );
            }
            if let Some(e) = s.epsilon.filter(|&e| !eps_ok(e)) {
                bail!("{}: {e}, expected 0 < ε < 1", at("epsilon"));
            }
            if let Some(r) = s.min_gap_ratio.filter(|r| !(0.0..=1.0).contains(r)) {
                bail!("{}: {r}, expected 0 ≤ ratio ≤ 1", at("min_gap_ratio"));
            }
            let (rows, k) = match s.shape.as_slice() {
                [.., r, k] => (*r as usize, *k as usize),
                _ => (0, 0),
            };
            for (p, ids) in &s.near_ties {
                if *p >= rows || ids.len() != k || s.dtype != ElemType::I32 {
                    bail!(
                        "{}: position {p} with {} ids, expected a position below {rows} with {k} ids of an I32 top-k stage",
                        at("near_ties"),
                        ids.len()
                    );
                }
            }
        }
        if let Some(l) = &self.logits {
            if l.positions == 0 || l.vocab == 0 {
                bail!(
                    "logits: {} positions of vocab {}, expected both above 0",
                    l.positions,
                    l.vocab
                );
            }
            for (field, len) in [
                ("top1", l.top1.len()),
                ("margin", l.margin.len()),
                ("entropy", l.entropy.len()),
                ("absmax", l.absmax.len()),
            ] {
                if len != l.positions {
                    bail!(
                        "logits.{field}: {len} entries for {} positions",
                        l.positions
                    );
                }
            }
            if let Some(p) = l.top1.iter().position(|&t| t as usize >= l.vocab) {
                bail!(
                    "logits.top1[{p}]: token {} is not below vocab {}",
                    l.top1[p],
                    l.vocab
                );
            }
            let bad = |xs: &[f64]| xs.iter().position(|v| *v < 0.0);
            for (field, xs) in [
                ("margin", &l.margin),
                ("entropy", &l.entropy),
                ("absmax", &l.absmax),
            ] {
                if let Some(p) = bad(xs) {
                    bail!("logits.{field}[{p}]: {} is negative", xs[p]);
                }
            }
        }
        Ok(())
    }

    /// The file's text: keys in a fixed order, the header indented, one line per stage and per
    /// logits array, a final newline.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\n");
        let mut field = |key: &str, value: String, last: bool| {
            let _ = writeln!(out, "  \"{key}\": {value}{}", if last { "" } else { "," });
        };
        field("format", j(&self.format), false);
        field("version", j(&self.version), false);
        field("producer", j(&self.producer), false);
        field("model", j(&self.model), false);
        field("backend", j(&self.backend), false);
        field("dtype", j(&self.dtype), false);
        field("tp", j(&self.tp), false);
        field("ep", j(&self.ep), false);
        field("tokens", j(&self.tokens), false);
        field("limits", j(&self.limits), false);
        let stages: Vec<String> = self
            .stages
            .iter()
            .map(|s| format!("    {}", j(s)))
            .collect();
        field(
            "stages",
            format!("[\n{}\n  ]", stages.join(",\n")),
            self.logits.is_none(),
        );
        if let Some(l) = &self.logits {
            let lines = [
                format!("\"positions\": {}", l.positions),
                format!("\"vocab\": {}", l.vocab),
                format!("\"entropy_mean\": {}", j(&l.entropy_mean)),
                format!("\"flat\": {}", l.flat),
                format!("\"top1\": {}", j(&l.top1)),
                format!("\"margin\": {}", j(&l.margin)),
                format!("\"entropy\": {}", j(&l.entropy)),
                format!("\"absmax\": {}", j(&l.absmax)),
            ];
            field(
                "logits",
                format!("{{\n    {}\n  }}", lines.join(",\n    ")),
                true,
            );
        }
        out.push_str("}\n");
        out
    }
}

/// `ep` as the producer of a run recorded it (false when it did not say).
pub fn run_ep(producer: &Map<String, Value>) -> bool {
    producer.get("ep").and_then(Value::as_bool).unwrap_or(false)
}

/// Compact JSON of a baseline field.
fn j<T: Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string(v).expect("baseline fields have string keys only")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_dtype() {
        let f32 = Limits::for_dtype("f32").unwrap();
        assert_eq!(f32.epsilon, 64.0 * 2f64.powi(-24));
        let bf16 = Limits::for_dtype("bf16").unwrap();
        assert_eq!(bf16.epsilon, 16.0 / 256.0);
        assert!(Limits::for_dtype("fp8").is_none());
    }

    #[test]
    fn logits_rows_give_top1_margin_and_entropy() {
        let l = logits_rows(&[0.0, 3.0, 1.0, 0.0, 0.0, 0.0], 3);
        assert_eq!(l.top1, vec![1, 0]);
        assert_eq!(l.margin, vec![2.0, 0.0]);
        assert!((l.entropy[1] - 3f64.ln()).abs() < 1e-12);
        assert_eq!(l.absmax, vec![3.0, 0.0]);
        assert!(!l.flat);
    }
}
