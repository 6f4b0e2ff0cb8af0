//! An attention whose output diverges while its query, keys and values agree, tested against
//! one hypothesis with evidence: the same attention under another softmax scale. The reference's
//! own recorded inputs are attended again at scales around its own; a scale that reproduces the
//! candidate's output (its values, or its norm and sketch where only statistics were kept) to
//! within the stage's tolerance is named, with what it is in the model's terms (YaRN's mscale²
//! left out or applied twice, or a head size's square root).

use anyhow::Result;

use super::fault::{Fault, FaultClass};
use super::metrics::Metrics;
use super::stage_diff::{whole_values, StageDiff, Status};
use crate::model::{Glm5Config, Stage};
use crate::trace::stats::TensorStats;
use crate::trace::Trace;

/// The inputs that must agree for the attention op itself to be at fault.
const INPUTS: [&str; 4] = ["attn.q", "attn.q_rope", "attn.kv", "attn.k_rope"];

/// Scale multipliers tried before refining: 2^-4 .. 2^4 in steps of 2^(1/16).
const GRID: i32 = 64;

/// The most multiply-adds one attention pass may take (query·key products and value sums over
/// every head): some 250 passes fit a scale, so a long prompt at full width (its scores alone
/// t²·heads) is left unfitted rather than held for minutes; GLM-5's widths fit some 60 tokens.
const BUDGET: usize = 1 << 26;

/// The reference's own inputs of one layer's attention, per head.
struct Inputs {
    t: usize,
    heads: usize,
    nope: usize,
    rope: usize,
    v: usize,
    q: Vec<f32>,
    q_rope: Vec<f32>,
    kv: Vec<f32>,
    k_rope: Vec<f32>,
    /// Each position's keys: the DSA selection where recorded, else every earlier position.
    keys: Vec<Vec<usize>>,
}

impl Inputs {
    /// `q·k` of every head, query and key it sees (unscaled), computed once.
    fn scores(&self) -> Vec<Vec<Vec<f64>>> {
        let (h_all, qk, kvw) = (self.heads, self.nope + self.rope, self.nope + self.v);
        (0..h_all)
            .map(|h| {
                (0..self.t)
                    .map(|i| {
                        let q = &self.q[(i * h_all + h) * qk..][..self.nope];
                        let qr = &self.q_rope[(i * h_all + h) * self.rope..][..self.rope];
                        self.keys[i]
                            .iter()
                            .map(|&j| {
                                let k = &self.kv[(j * h_all + h) * kvw..][..self.nope];
                                let kr = &self.k_rope[j * self.rope..][..self.rope];
                                dot(q, k) + dot(qr, kr)
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect()
    }

    /// The attention output `[t, heads in range, v]` at softmax scale `scale`.
    fn attend(
        &self,
        scores: &[Vec<Vec<f64>>],
        heads: std::ops::Range<usize>,
        scale: f64,
    ) -> Vec<f32> {
        let kvw = self.nope + self.v;
        let mut out = vec![0f32; self.t * heads.len() * self.v];
        for i in 0..self.t {
            for (slot, h) in heads.clone().enumerate() {
                let s = &scores[h][i];
                let top = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = s.iter().map(|x| ((x - top) * scale).exp()).collect();
                let sum: f64 = w.iter().sum();
                let o = &mut out[(i * heads.len() + slot) * self.v..][..self.v];
                for (&j, wj) in self.keys[i].iter().zip(&w) {
                    let val = &self.kv[(j * self.heads + h) * kvw + self.nope..][..self.v];
                    for (x, &y) in o.iter_mut().zip(val) {
                        *x += (wj / sum * f64::from(y)) as f32;
                    }
                }
            }
        }
        out
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum()
}

/// What the candidate holds at the diverging stage (values if kept, else its statistics), and
/// how far a tensor is from it: the exact `rel_diff`, or the larger of its lower bound from the
/// norms and the sketch's estimate; `None` where statistics carry no sketch (a norm alone fits
/// some scale whatever the fault).
enum Target {
    Values(Vec<f32>),
    Stats(TensorStats),
}

impl Target {
    fn distance(&self, x: &[f32]) -> Option<f64> {
        match self {
            Target::Values(y) => (y.len() == x.len()).then(|| Metrics::of(x, y).rel_diff),
            Target::Stats(c) => {
                let h = TensorStats::of(x);
                let norms =
                    (h.l2 - c.l2).powi(2) / (h.l2 * h.l2 + c.l2 * c.l2).max(f64::MIN_POSITIVE);
                Some(norms.max(h.sketch_rel_diff(c)?))
            }
        }
    }
}

/// The fault where `stages[i]` is an `attn.ctx` whose inputs agree and whose output is the
/// reference's attention under another softmax scale; `None` when it is not, or cannot be told.
pub fn softmax_scale_fault(
    reference: &Trace,
    candidate: &Trace,
    stages: &[StageDiff],
    i: usize,
) -> Result<Option<Fault>> {
    let s = &stages[i];
    let Some(stage) = Stage::parse(&s.stage).filter(|st| st.kind() == "attn.ctx") else {
        return Ok(None);
    };
    // Each input agrees, or the engine never forms it (llama.cpp's absorbed MLA has no
    // `attn.kv`): the fit below is the evidence, and a fault in what was not compared would not
    // fit a scale.
    let agrees = |kind: &str| {
        let name = stage.sibling(kind).map(|n| n.to_string());
        let mut compared = stages[..i]
            .iter()
            .filter(|p| Some(&p.stage) == name.as_ref() && (p.rank.is_none() || p.rank == s.rank))
            .peekable();
        match compared.peek() {
            None => candidate_lacks(candidate, name.as_deref()),
            Some(_) => compared.all(|p| p.status == Status::Pass),
        }
    };
    let rotated_seen = ["attn.q_rope", "attn.k_rope"].iter().all(|k| {
        !candidate_lacks(
            candidate,
            stage.sibling(k).map(|n| n.to_string()).as_deref(),
        )
    });
    if !rotated_seen || !INPUTS.iter().all(|k| agrees(k)) {
        return Ok(None);
    }
    let Ok(cfg) = serde_json::from_value::<Glm5Config>(reference.manifest().model.config.clone())
    else {
        return Ok(None);
    };
    let Some(inputs) = reference_inputs(reference, &stage)?.filter(|x| {
        let keys: usize = x.keys.iter().map(Vec::len).sum();
        keys.saturating_mul(x.heads)
            .saturating_mul(x.nope + x.rope + x.v)
            <= BUDGET
    }) else {
        return Ok(None);
    };
    let tp = candidate.manifest().tp.max(1) as usize;
    let heads = match s.rank {
        Some(r) if inputs.heads.is_multiple_of(tp) && (r as usize) < tp => {
            let per = inputs.heads / tp;
            r as usize * per..(r as usize + 1) * per
        }
        Some(_) => return Ok(None),
        None => 0..inputs.heads,
    };
    let target = match (s.rank, whole_values(candidate, &s.stage)?) {
        (None, Some((v, _))) => Target::Values(v),
        _ => match candidate.stage(&s.stage, s.rank) {
            Some(rec) => Target::Stats(rec.stats.clone()),
            None => return Ok(None),
        },
    };
    let scores = inputs.scores();
    let own = ((inputs.nope + inputs.rope) as f64).powf(-0.5) * cfg.yarn_softmax_factor();
    // The reference's own output must come back at its own scale, else the recorded layout is
    // not the one read here.
    let (ref_ctx, _) = whole_values(reference, &s.stage)?.unwrap_or_default();
    let all = inputs.attend(&scores, 0..inputs.heads, own);
    if ref_ctx.len() != all.len() || Metrics::of(&ref_ctx, &all).rel_diff > 1e-6 {
        return Ok(None);
    }
    let distance = |m: f64| target.distance(&inputs.attend(&scores, heads.clone(), own * m));
    let Some(at_own) = distance(1.0) else {
        return Ok(None);
    };
    // A multiplier the model's own numbers explain, where one fits; else the best fit.
    let named = named_multipliers(&cfg, &inputs)
        .into_iter()
        .filter_map(|(m, why)| Some((m, distance(m)?, why)))
        .filter(|(_, d, _)| *d <= s.tolerance)
        .min_by(|a, b| a.1.total_cmp(&b.1));
    let (m, fit, why) = match named {
        Some(found) => found,
        None => {
            let m = fitted_multiplier(&distance, at_own);
            (m, distance(m).unwrap_or(f64::INFINITY), String::new())
        }
    };
    if !(fit <= s.tolerance && fit < at_own && (m - 1.0).abs() > 1e-3) {
        return Ok(None);
    }
    let basis = match target {
        Target::Values(_) => "values",
        Target::Stats(_) => "norm and sketch (statistics kept)",
    };
    Ok(Some(Fault {
        class: FaultClass::ScaleMismatch,
        summary: format!(
            "{}: the attention's softmax scale is the reference's × {m:.4}{why}",
            s.stage
        ),
        evidence: vec![
            format!(
                "{} agree: the attention's query, keys and values are the reference's",
                INPUTS
                    .iter()
                    .filter_map(|k| stage.sibling(k).map(|n| n.to_string()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            format!(
                "the reference's inputs attended at scale {:.6} (the reference's {own:.6} × \
                 {m:.4}) match the candidate's {} within rel_diff {fit:.2e} (tolerance {:.0e}); \
                 at the reference's own scale, {at_own:.2e}",
                own * m,
                basis,
                s.tolerance
            ),
        ],
        weight: None,
    }))
}

/// The scale multiplier nearest the candidate: the best of a grid over 2^-4 .. 2^4, refined by
/// golden-section search on ln m within one grid step each side.
fn fitted_multiplier(distance: &dyn Fn(f64) -> Option<f64>, at_own: f64) -> f64 {
    let mut best = (1.0, at_own);
    for n in -GRID..=GRID {
        let m = 2f64.powf(f64::from(n) / 16.0);
        if let Some(d) = distance(m).filter(|&d| d < best.1) {
            best = (m, d);
        }
    }
    let (mut lo, mut hi) = (best.0.ln() - 0.05, best.0.ln() + 0.05);
    let phi = (5f64.sqrt() - 1.0) / 2.0;
    for _ in 0..60 {
        let (a, b) = (hi - phi * (hi - lo), lo + phi * (hi - lo));
        match (distance(a.exp()), distance(b.exp())) {
            (Some(da), Some(db)) if da <= db => hi = b,
            (Some(_), Some(_)) => lo = a,
            _ => break,
        }
    }
    ((lo + hi) / 2.0).exp()
}

/// Whether the candidate's trace holds no stage `name` (one it never computed).
fn candidate_lacks(candidate: &Trace, name: Option<&str>) -> bool {
    name.is_some_and(|n| candidate.stages().iter().all(|r| r.name != n))
}

/// The multipliers the model's own numbers explain: YaRN's mscale² (the softmax multiplier the
/// config gives) left out or applied twice, or another head size's square root in the scale.
fn named_multipliers(cfg: &Glm5Config, inputs: &Inputs) -> Vec<(f64, String)> {
    let mut named = Vec::new();
    let yarn = cfg.yarn_softmax_factor();
    if yarn != 1.0 {
        named.push((
            1.0 / yarn,
            format!(": YaRN's mscale² ({yarn:.4}, from mscale_all_dim) left out"),
        ));
        named.push((yarn, format!(": YaRN's mscale² ({yarn:.4}) applied twice")));
    }
    let qk = (inputs.nope + inputs.rope) as f64;
    let other_sizes = [
        (inputs.nope as f64, "qk_nope_head_dim"),
        (inputs.v as f64, "v_head_dim"),
        (
            (cfg.kv_lora_rank + cfg.qk_rope_head_dim) as f64,
            "kv_lora_rank + qk_rope_head_dim",
        ),
    ];
    for (size, name) in other_sizes {
        if size > 0.0 && size != qk {
            named.push((
                (qk / size).sqrt(),
                format!(": 1/√{size} ({name}) where the model divides by √{qk}"),
            ));
        }
    }
    named
}

/// The reference's recorded query, keys and values of `stage`'s layer (a single prompt, every
/// stage kept whole), with each position's keys.
fn reference_inputs(reference: &Trace, stage: &Stage) -> Result<Option<Inputs>> {
    let get = |kind: &str| -> Result<Option<(Vec<f32>, Vec<u64>)>> {
        match stage.sibling(kind) {
            Some(name) => whole_values(reference, &name.to_string()),
            None => Ok(None),
        }
    };
    let (Some((q, qs)), Some((q_rope, rs)), Some((kv, ks)), Some((k_rope, kr))) = (
        get("attn.q")?,
        get("attn.q_rope")?,
        get("attn.kv")?,
        get("attn.k_rope")?,
    ) else {
        return Ok(None);
    };
    let [t, heads, qk] = qs[..] else {
        return Ok(None);
    };
    let [_, _, rope] = rs[..] else {
        return Ok(None);
    };
    let [tk, hk, kvw] = ks[..] else {
        return Ok(None);
    };
    let (t, heads, qk, rope, kvw) = (
        t as usize,
        heads as usize,
        qk as usize,
        rope as usize,
        kvw as usize,
    );
    let nope = qk.saturating_sub(rope);
    if tk as usize != t || hk as usize != heads || kr != [tk, rope as u64] || kvw <= nope {
        return Ok(None);
    }
    let keys = match get("attn.index_topk")? {
        Some((ids, shape)) if shape.len() == 2 && shape[0] as usize == t => {
            let k = shape[1] as usize;
            ids.chunks(k.max(1))
                .map(|row| {
                    row.iter()
                        .filter(|&&j| j >= 0.0 && (j as usize) < t)
                        .map(|&j| j as usize)
                        .collect()
                })
                .collect()
        }
        Some(_) => return Ok(None),
        None => (0..t).map(|i| (0..=i).collect()).collect(),
    };
    Ok(Some(Inputs {
        t,
        heads,
        nope,
        rope,
        v: kvw - nope,
        q,
        q_rope,
        kv,
        k_rope,
        keys,
    }))
}
