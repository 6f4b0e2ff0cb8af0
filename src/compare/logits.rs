//! Logits health and logits against a reference: what "the model prints garbage" looks like in
//! numbers (entropy near ln V, a flat top-1, one token forever) and llama.cpp's statistics of a
//! candidate against a reference (KL divergence, top-1 agreement, Δp).

use serde::{Deserialize, Serialize};

/// A candidate agreeing with its reference on fewer top-1 tokens than this fails.
pub const MIN_TOP1_AGREEMENT: f64 = 0.9;

/// The longest run of one top-1 token that still passes (the `$\ $\ $\` signature is longer).
pub const MAX_REPEAT: usize = 4;

/// What makes these logits garbage, in words: NaN/Inf, a flat distribution, one token repeated,
/// and against a reference, top-1 agreement below [`MIN_TOP1_AGREEMENT`]. Empty: they pass.
pub fn problems(health: &LogitsHealth, against: Option<&LogitsComparison>) -> Vec<String> {
    let mut problems = Vec::new();
    if health.nan + health.inf > 0 {
        problems.push(format!("{} NaN and {} Inf logits", health.nan, health.inf));
    }
    if health.flat {
        problems.push(format!(
            "flat: mean entropy {:.3} of ln V = {:.3}",
            health.entropy_mean, health.ln_vocab
        ));
    }
    if health.longest_repeat > MAX_REPEAT {
        problems.push(format!(
            "one token is the top-1 at {} positions in a row",
            health.longest_repeat
        ));
    }
    if let Some(c) = against {
        if c.top1_agreement < MIN_TOP1_AGREEMENT {
            problems.push(format!(
                "top-1 agrees with the reference at {:.1}% of positions",
                100.0 * c.top1_agreement
            ));
        }
    }
    problems
}

/// Softmax of one position's logits, computed in f64.
fn probabilities(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f64> = row
        .iter()
        .map(|&v| (f64::from(v) - f64::from(max)).exp())
        .collect();
    let sum: f64 = exp.iter().sum();
    exp.into_iter().map(|e| e / sum).collect()
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .unwrap_or(0)
}

/// One trace's logits on their own.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogitsHealth {
    pub positions: usize,
    pub vocab: usize,
    /// ln V: the entropy of a uniform distribution.
    pub ln_vocab: f64,
    pub entropy_mean: f64,
    pub entropy_max: f64,
    pub top1_prob_mean: f64,
    /// Mean gap between the two largest logits.
    pub margin_mean: f64,
    pub logit_std_mean: f64,
    pub nan: u64,
    pub inf: u64,
    pub top1: Vec<usize>,
    /// The longest run of one token among the per-position top-1s (the `$\ $\ $\` signature).
    pub longest_repeat: usize,
    /// Mean entropy at least 90% of ln V: next to no information.
    pub flat: bool,
}

impl LogitsHealth {
    /// `logits` is `[positions, vocab]` row-major.
    pub fn of(logits: &[f32], vocab: usize) -> LogitsHealth {
        let rows: Vec<&[f32]> = logits.chunks_exact(vocab.max(1)).collect();
        let n = rows.len().max(1) as f64;
        let (mut ent_sum, mut ent_max, mut p_sum, mut margin_sum, mut std_sum) =
            (0.0, 0.0f64, 0.0, 0.0, 0.0);
        let mut top1 = Vec::with_capacity(rows.len());
        for row in &rows {
            let p = probabilities(row);
            let entropy: f64 = -p
                .iter()
                .filter(|&&q| q > 0.0)
                .map(|q| q * q.ln())
                .sum::<f64>();
            ent_sum += entropy;
            ent_max = ent_max.max(entropy);
            let best = argmax(row);
            top1.push(best);
            p_sum += p[best];
            let second = (0..row.len())
                .filter(|&i| i != best)
                .map(|i| row[i])
                .fold(f32::NEG_INFINITY, f32::max);
            margin_sum += f64::from(row[best]) - f64::from(second);
            let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / row.len() as f64;
            let var = row
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / row.len() as f64;
            std_sum += var.sqrt();
        }
        let ln_vocab = (vocab as f64).ln();
        let entropy_mean = ent_sum / n;
        LogitsHealth {
            positions: rows.len(),
            vocab,
            ln_vocab,
            entropy_mean,
            entropy_max: ent_max,
            top1_prob_mean: p_sum / n,
            margin_mean: margin_sum / n,
            logit_std_mean: std_sum / n,
            nan: logits.iter().filter(|v| v.is_nan()).count() as u64,
            inf: logits.iter().filter(|v| v.is_infinite()).count() as u64,
            longest_repeat: longest_run(&top1),
            top1,
            flat: entropy_mean >= 0.9 * ln_vocab,
        }
    }
}

/// The longest run of equal consecutive values.
pub fn longest_run<T: PartialEq>(xs: &[T]) -> usize {
    let (mut best, mut run) = (0, 0);
    for (i, x) in xs.iter().enumerate() {
        run = if i > 0 && xs[i - 1] == *x { run + 1 } else { 1 };
        best = best.max(run);
    }
    best
}

/// A candidate's logits against the reference's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LogitsComparison {
    /// KL(reference ‖ candidate) per position: mean, 99th percentile, max.
    pub kl_mean: f64,
    pub kl_p99: f64,
    pub kl_max: f64,
    /// Positions whose top-1 token is the reference's.
    pub top1_agreement: f64,
    /// Candidate minus reference probability of the reference's top-1 token: mean and the most
    /// negative.
    pub delta_p_mean: f64,
    pub delta_p_min: f64,
}

impl LogitsComparison {
    pub fn of(reference: &[f32], candidate: &[f32], vocab: usize) -> LogitsComparison {
        let rows = reference.len() / vocab.max(1);
        let (mut kls, mut agree, mut dps) = (Vec::new(), 0usize, Vec::new());
        for r in 0..rows {
            let (x, y) = (
                &reference[r * vocab..(r + 1) * vocab],
                &candidate[r * vocab..(r + 1) * vocab],
            );
            let (p, q) = (probabilities(x), probabilities(y));
            let kl: f64 = p
                .iter()
                .zip(&q)
                .filter(|(&a, _)| a > 0.0)
                .map(|(&a, &b)| a * (a.ln() - b.max(f64::MIN_POSITIVE).ln()))
                .sum();
            kls.push(if kl.is_nan() {
                f64::INFINITY
            } else {
                kl.max(0.0)
            });
            let best = argmax(x);
            agree += usize::from(argmax(y) == best);
            dps.push(q[best] - p[best]);
        }
        let n = rows.max(1) as f64;
        let mut sorted = kls.clone();
        sorted.sort_by(f64::total_cmp);
        let p99 = sorted
            .get(((sorted.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0);
        LogitsComparison {
            kl_mean: kls.iter().sum::<f64>() / n,
            kl_p99: p99,
            kl_max: sorted.last().copied().unwrap_or(0.0),
            top1_agreement: agree as f64 / n,
            delta_p_mean: dps.iter().sum::<f64>() / n,
            delta_p_min: dps.iter().copied().fold(0.0, f64::min),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_are_flat_and_peaked_ones_are_not() {
        let flat = LogitsHealth::of(&[0.0; 8], 4);
        assert!(flat.flat && (flat.entropy_mean - 4f64.ln()).abs() < 1e-12);
        assert_eq!(flat.longest_repeat, 2);
        let peaked = LogitsHealth::of(&[9.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 0.0], 4);
        assert!(!peaked.flat && peaked.top1 == vec![0, 2] && peaked.longest_repeat == 1);
    }

    #[test]
    fn identical_logits_have_zero_kl_and_full_agreement() {
        let x = [1.0, 2.0, 0.5, -1.0, 3.0, 0.0];
        let c = LogitsComparison::of(&x, &x, 3);
        assert_eq!(
            (c.kl_max, c.top1_agreement, c.delta_p_mean),
            (0.0, 1.0, 0.0)
        );
    }
}
