//! The fault class of a first divergence, from what two traces alone show (docs/design.md §7):
//! new NaN or Inf, a constant scale, the same values in another order, flat logits, another
//! expert choice, or error that grew without a jump (precision).

use anyhow::Result;

use super::fault::{Fault, FaultClass};
use super::logits::LogitsHealth;
use super::metrics::Metrics;
use super::parts::{from_disagreement, from_parts};
use super::softmax_fit::softmax_scale_fault;
use super::stage_diff::{whole_values, Basis, StageDiff, Status};
use super::sum_fit::sum_fault;
use crate::model::Stage;
use crate::trace::Trace;

/// An error at least this many times its input's is made at this stage, not inherited.
pub const LOCAL_JUMP: f64 = 10.0;

/// The largest finite value of a dtype.
fn dtype_max(dtype: &str) -> f64 {
    match dtype {
        "f16" => 65504.0,
        "bf16" => 3.389_531_4e38,
        "f64" => f64::MAX,
        _ => f64::from(f32::MAX),
    }
}

fn fault(class: FaultClass, summary: String, evidence: Vec<String>) -> Fault {
    Fault {
        class,
        summary,
        evidence,
        weight: None,
    }
}

/// Classify the divergence at `stages[i]`; `calibrated` when tolerances came from an envelope.
pub fn classify(
    reference: &Trace,
    candidate: &Trace,
    stages: &[StageDiff],
    i: usize,
    calibrated: bool,
) -> Result<Fault> {
    let s = &stages[i];
    let at = &s.stage;
    let (r, c) = (&s.reference, &s.candidate);
    let prev = stages[..i]
        .iter()
        .rev()
        .find(|p| p.basis != Basis::Ids && p.rank.is_none());
    let inputs_finite = prev.is_none_or(|p| p.candidate.non_finite() <= p.reference.non_finite());
    let input_note = match prev {
        Some(p) => format!("its input {} is finite in the candidate", p.stage),
        None => "it is the first stage".into(),
    };
    let dtype = candidate.manifest().dtype.as_str();

    if c.inf > r.inf || (c.absmax > dtype_max(dtype) && inputs_finite) {
        return Ok(fault(
            FaultClass::DtypeOverflow,
            format!("{at} leaves the {dtype} range"),
            vec![
                format!(
                    "{at}: {} Inf in the candidate, {} in the reference; reference absmax {:e}",
                    c.inf, r.inf, r.absmax
                ),
                format!("{dtype} holds at most {:e}; {input_note}", dtype_max(dtype)),
            ],
        ));
    }
    if c.nan > r.nan && inputs_finite {
        return Ok(fault(
            FaultClass::NanOrigin,
            format!("the first NaN appears at {at}"),
            vec![format!(
                "{at}: {} NaN in the candidate, {} in the reference; {input_note}",
                c.nan, r.nan
            )],
        ));
    }
    if s.basis == Basis::Ids {
        return top_k_fault(reference, candidate, s, dtype);
    }
    if let Some(f) = from_parts(reference, candidate, s)? {
        return Ok(f);
    }
    if let Some(f) = from_disagreement(candidate, s) {
        return Ok(f);
    }
    if let Some(f) = op_fault(stages, i) {
        return Ok(f);
    }
    if let Some(f) = softmax_scale_fault(reference, candidate, stages, i)? {
        return Ok(f);
    }
    if let Some(f) = sum_fault(reference, candidate, stages, i)? {
        return Ok(f);
    }
    // Another top-k choice earlier in this layer explains what follows it.
    if let Some(choice) = stages[..i]
        .iter()
        .rev()
        .take_while(|p| p.layer == s.layer)
        .find(|p| p.basis == Basis::Ids && p.rel_diff > 0.0)
    {
        let mut f = top_k_fault(reference, candidate, choice, dtype)?;
        f.summary = format!("{}; {at} diverges after it", f.summary);
        f.evidence.push(format!(
            "{at}: rel_diff {:e} (tolerance {:e})",
            s.rel_diff, s.tolerance
        ));
        return Ok(f);
    }
    if at == "logits" {
        if let (Some((x, shape)), Some((y, _))) =
            (whole_values(reference, at)?, whole_values(candidate, at)?)
        {
            let vocab = *shape.last().unwrap_or(&1) as usize;
            let tp = candidate.manifest().tp as usize;
            if let Some(map) = vocab_blocks_moved(&x, &y, vocab, tp) {
                let moved: Vec<String> = map
                    .iter()
                    .enumerate()
                    .filter(|(b, q)| b != *q)
                    .map(|(b, q)| format!("block {b} holds the reference's block {q}"))
                    .collect();
                return Ok(fault(
                    FaultClass::WrongShardLayout,
                    "the logits are the reference's with their vocabulary blocks in another \
                     order: the ranks' parts gathered in the wrong order"
                        .into(),
                    vec![format!(
                        "the vocabulary in {tp} blocks of {} (one per rank): {}; every block \
                         within rel_diff {VOCAB_BLOCK_SAME:e} of the block it holds",
                        vocab / tp,
                        moved.join(", ")
                    )],
                ));
            }
            let (hr, hc) = (LogitsHealth::of(&x, vocab), LogitsHealth::of(&y, vocab));
            if hc.flat && !hr.flat {
                return Ok(fault(
                    FaultClass::FlatLogits,
                    "the candidate's logits are near uniform where the reference's are peaked"
                        .into(),
                    vec![
                        format!(
                            "mean entropy {:.3} nats of ln V = {:.3} (reference {:.3})",
                            hc.entropy_mean, hc.ln_vocab, hr.entropy_mean
                        ),
                        format!(
                            "top-1 probability {:.4} (reference {:.4})",
                            hc.top1_prob_mean, hr.top1_prob_mean
                        ),
                    ],
                ));
            }
        }
    }
    if let Some(m) = &s.metrics {
        if m.cosine >= 0.9999 && (m.norm_ratio - 1.0).abs() > 1e-3 {
            return Ok(fault(
                FaultClass::ScaleMismatch,
                format!("{at} is the reference times {:.4}", m.norm_ratio),
                vec![format!(
                    "cosine {:.6} with norm ratio {:.6} at {at}",
                    m.cosine, m.norm_ratio
                )],
            ));
        }
        if c.l2 == 0.0 && r.l2 > 0.0 {
            return Ok(fault(
                FaultClass::Unknown,
                format!("{at} is all zeros in the candidate"),
                vec![format!("reference l2 {:e}, candidate 0", r.l2)],
            ));
        }
        if let (Some((mut x, _)), Some((mut y, _))) =
            (whole_values(reference, at)?, whole_values(candidate, at)?)
        {
            x.sort_by(f32::total_cmp);
            y.sort_by(f32::total_cmp);
            if x == y {
                return Ok(fault(
                    FaultClass::WeightLayout,
                    format!("{at} holds the reference's values in another order"),
                    vec![format!(
                        "the same {} values, sorted, yet cosine {:.4}: a permutation (heads, \
                         pairs, experts or a transpose)",
                        x.len(),
                        m.cosine
                    )],
                ));
            }
        }
    }
    let local = s.amplification.is_none_or(|a| a >= LOCAL_JUMP);
    let jump = s
        .amplification
        .map(|a| match a.is_infinite() {
            true => "error made here, on an input that matched exactly".into(),
            false => format!("error {a:.3e}× its input's"),
        })
        .unwrap_or_else(|| "no earlier stage".into());
    if !local && (calibrated || !matches!(dtype, "f32" | "f64")) {
        return Ok(fault(
            FaultClass::PrecisionLoss,
            format!("{at}: error grown through the stages at {dtype}, without a jump"),
            vec![format!("rel_diff {:e} at {at}; {jump}", s.rel_diff)],
        ));
    }
    Ok(fault(
        FaultClass::Unknown,
        format!("{at} diverges: rel_diff {:e}", s.rel_diff),
        vec![
            format!("{jump} ({})", if local { "made here" } else { "inherited" }),
            format!("tolerance {:e}", s.tolerance),
        ],
    ))
}

/// Two vocabulary blocks this close (`rel_diff`) hold the same logits.
const VOCAB_BLOCK_SAME: f64 = 1e-3;

/// Where the candidate's logits `y` hold the reference's `x` with the vocabulary's `tp` blocks
/// (rows of `vocab`) in another order: per candidate block, the reference block it holds; `None`
/// unless every block holds one and some block moved.
fn vocab_blocks_moved(x: &[f32], y: &[f32], vocab: usize, tp: usize) -> Option<Vec<usize>> {
    if tp < 2 || vocab == 0 || !vocab.is_multiple_of(tp) || x.len() != y.len() {
        return None;
    }
    let width = vocab / tp;
    let block = |v: &[f32], b: usize| -> Vec<f32> {
        v.chunks(vocab)
            .flat_map(|row| row[b * width..(b + 1) * width].iter().copied())
            .collect()
    };
    let map: Vec<usize> = (0..tp)
        .map(|b| {
            let mine = block(y, b);
            (0..tp).find(|&q| Metrics::of(&block(x, q), &mine).rel_diff <= VOCAB_BLOCK_SAME)
        })
        .collect::<Option<_>>()?;
    map.iter().enumerate().any(|(b, q)| b != *q).then_some(map)
}

/// Faults of one op whose input still agrees: the rotary embedding, and the routing weights
/// of an unchanged expert choice.
fn op_fault(stages: &[StageDiff], i: usize) -> Option<Fault> {
    let s = &stages[i];
    let stage = Stage::parse(&s.stage)?;
    // The input whole, or the same rank's part where the stage diverged in one rank's part.
    let agrees = |kind: &str| {
        let name = stage.sibling(kind)?.to_string();
        stages[..i]
            .iter()
            .rev()
            .find(|p| p.stage == name && (p.rank.is_none() || p.rank == s.rank))
            .filter(|p| p.status == Status::Pass)
    };
    let rope_input = match stage.kind() {
        "attn.q_rope" => agrees("attn.q"),
        "attn.k_rope" => agrees("attn.kv_a"),
        _ => None,
    };
    if let Some(p) = rope_input {
        return Some(fault(
            FaultClass::RopeMismatch,
            format!("{}: the rotation differs while its input agrees", s.stage),
            vec![format!(
                "{} agrees (rel_diff {:.2e}); {} after RoPE does not (rel_diff {:.2e}): the \
                 rotary style (interleaved or NeoX pairs), theta or positions differ",
                p.stage, p.rel_diff, s.stage, s.rel_diff
            )],
        ));
    }
    if stage.kind() == "moe.topk_weights" {
        // The same experts at every position: a top-k stage a lower precision passes on near
        // ties may still hold other choices.
        let ids = agrees("moe.topk_ids").filter(|p| p.rel_diff == 0.0)?;
        let logits = agrees("moe.router_logits")?;
        return Some(fault(
            FaultClass::RouterMismatch,
            format!("{}: the same experts with other weights", s.stage),
            vec![format!(
                "{} and {} agree; {} does not (rel_diff {:.2e}): the scoring function \
                 (sigmoid or softmax), the normalisation or the scaling factor differs",
                logits.stage, ids.stage, s.stage, s.rel_diff
            )],
        ));
    }
    None
}

/// A reference gap at most this share of its layer's largest is a near tie, which a run in a
/// lower precision may break the other way.
pub const NEAR_TIE: f64 = 0.01;

/// Another top-k choice: near ties broken differently at a lower precision, or a real change
/// (the router's for MoE stages, the DSA indexer's for `attn.index_topk`).
fn top_k_fault(reference: &Trace, candidate: &Trace, s: &StageDiff, dtype: &str) -> Result<Fault> {
    let at = &s.stage;
    let gap_stage = Stage::parse(at)
        .and_then(|stage| stage.gaps())
        .map(|g| g.to_string());
    let mut evidence = vec![format!(
        "{:.1}% of positions choose a different set at {at}",
        100.0 * s.rel_diff
    )];
    let sides = (whole_values(reference, at)?, whole_values(candidate, at)?);
    let gaps = match gap_stage.filter(|g| reference.stage(g, None).is_some()) {
        Some(g) => whole_values(reference, &g)?,
        None => None,
    };
    let mut near_ties_only = false;
    let mut other_k = false;
    if let ((Some((x, xs)), Some((y, ys))), Some((gaps, _))) = (sides, gaps) {
        let k_of = |shape: &[u64]| (*shape.last().unwrap_or(&1)).max(1) as usize;
        let (kx, ky) = (k_of(&xs), k_of(&ys));
        if kx != ky {
            other_k = true;
            evidence.push(format!(
                "the candidate chooses {ky} per position where the reference chooses {kx}"
            ));
        }
        let set = |v: &[f32]| {
            let mut s: Vec<i64> = v.iter().map(|&i| i as i64).filter(|&i| i >= 0).collect();
            s.sort_unstable();
            s
        };
        // A hostile trace may disagree on sizes: only positions all three hold are read.
        let positions = gaps.len().min(x.len() / kx).min(y.len() / ky);
        let flipped: Vec<usize> = (0..positions)
            .filter(|&p| set(&x[p * kx..(p + 1) * kx]) != set(&y[p * ky..(p + 1) * ky]))
            .collect();
        let largest = gaps.iter().copied().fold(0f32, f32::max);
        // A negative gap marks a position with no boundary (every candidate chosen): never a tie.
        let tie =
            |p: &usize| gaps[*p] >= 0.0 && f64::from(gaps[*p]) <= NEAR_TIE * f64::from(largest);
        near_ties_only = !other_k && !flipped.is_empty() && flipped.iter().all(tie);
        let listed: Vec<String> = flipped
            .iter()
            .take(8)
            .map(|&p| match gaps[p] {
                g if g < 0.0 => format!(
                    "position {p} (the reference chooses all {} candidates: no boundary)",
                    set(&x[p * kx..(p + 1) * kx]).len()
                ),
                g => format!("position {p} (reference gap {g:.3e})"),
            })
            .collect();
        evidence.push(format!(
            "differing positions: {}; the layer's largest gap is {largest:.3e}",
            listed.join(", ")
        ));
    }
    if near_ties_only && !matches!(dtype, "f32" | "f64") {
        return Ok(fault(
            FaultClass::PrecisionLoss,
            format!("{at}: near ties broken differently at {dtype}"),
            evidence,
        ));
    }
    let (class, chooser) = match Stage::parse(at).map(|s| s.kind().to_string()) {
        Some(k) if k.starts_with("moe.") => (FaultClass::RouterMismatch, "the router"),
        Some(k) if k == "attn.index_topk" => (FaultClass::IndexerMismatch, "the DSA indexer"),
        _ => (FaultClass::Unknown, "a top-k"),
    };
    let summary = match other_k {
        true => format!("{at}: {chooser} chooses another number of entries"),
        false => format!("{at}: {chooser} makes another top-k choice"),
    };
    Ok(fault(class, summary, evidence))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_with_vocabulary_blocks_rotated_are_a_block_map() {
        // Two positions, vocabulary 6 in 3 blocks of 2; the candidate holds blocks 1, 2, 0.
        let x: Vec<f32> = (0..12).map(|i| (i * 7 % 11) as f32 - 5.0).collect();
        let y: Vec<f32> = x
            .chunks(6)
            .flat_map(|r| [&r[2..4], &r[4..6], &r[0..2]].concat())
            .collect();
        assert_eq!(vocab_blocks_moved(&x, &y, 6, 3), Some(vec![1, 2, 0]));
        assert_eq!(vocab_blocks_moved(&x, &x, 6, 3), None);
        assert_eq!(vocab_blocks_moved(&x, &y, 6, 1), None);
    }
}
