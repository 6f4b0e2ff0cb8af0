//! A server's top-k log-probabilities against the reference's full logits, position by position
//! (`glmcheck endpoint`), and the server's own health as far as its top-k shows it.
//!
//! A server hands back only its k most probable tokens (and, at a prompt position, the prompt's
//! own token), so the comparison is made on what it gave:
//!
//! * **KL(reference ‖ server)** over a coarsened vocabulary: one bucket per token the server
//!   listed, one bucket for every other token. The reference's mass in a bucket is its
//!   probability of that token (the rest bucket: one minus the listed tokens' sum); the
//!   server's is its listed probability (the rest: one minus its listed sum, at least 10⁻¹²).
//!   Merging tokens into buckets can only lower a KL, so this is a lower bound of the full KL.
//! * **top-1**: the server's most probable listed token against the reference's argmax.
//! * **Δp**: the server's probability of the reference's top-1 minus the reference's, the
//!   server's taken as 0 where it did not list that token (it is below the server's k-th).
//! * **max |Δ logprob|**: over the tokens the server listed, whose reference log-probability
//!   is known exactly.
//!
//! A position *parts* from the reference when a listed token's log-probability is off by more
//! than the tolerance, or the top-1 differs and the reference puts the server's top-1 more than
//! the tolerance below its own (a top-1 swap within the tolerance is a near tie, not a fault).

use serde::Serialize;

use super::logits::{longest_run, MAX_REPEAT, MIN_TOP1_AGREEMENT};

/// The default tolerance on a log-probability, in nats: a GPU serving in bf16 stays well
/// within it on a healthy model, a fault leaves it far behind.
pub const DEFAULT_TOLERANCE: f64 = 0.5;

/// The element type of a server's KV cache (`--kv-type`), which sets the default tolerance: the
/// cache rounds every key and value the attention reads, and a cache coarser than the model's
/// own arithmetic moves log-probabilities by more than the kernels do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Fp8,
    Q4_0,
}

impl KvType {
    pub const ALL: [KvType; 6] = [
        KvType::F32,
        KvType::F16,
        KvType::Bf16,
        KvType::Q8_0,
        KvType::Fp8,
        KvType::Q4_0,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Fp8 => "fp8",
            KvType::Q4_0 => "q4_0",
        }
    }

    /// The tolerance (nats) a server with this cache is held to: f32 far above the 1e-5 an f32
    /// server was measured at, the 16-bit types above their rounding's reach on the listed
    /// tail, bf16 at [`DEFAULT_TOLERANCE`] (a GPU serving in bf16), the 8- and 4-bit caches
    /// looser; a fault moves log-probabilities by whole nats.
    pub fn tolerance(self) -> f64 {
        match self {
            KvType::F32 => 0.05,
            KvType::F16 => 0.1,
            KvType::Q8_0 => 0.2,
            KvType::Bf16 => DEFAULT_TOLERANCE,
            KvType::Fp8 | KvType::Q4_0 => 1.0,
        }
    }
}

/// A server whose mean top-1 probability is below this many times 1/V is flat: its top choice
/// is hardly more likely than a uniform draw.
pub const FLAT_TOP1_TIMES_UNIFORM: f64 = 2.0;

/// The least probability the server's rest bucket is given in the KL.
const REST_FLOOR: f64 = 1e-12;

/// One position compared.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PositionDiff {
    /// The prompt position whose next-token distribution this is (0-based).
    pub position: usize,
    pub reference_top1: u32,
    pub server_top1: u32,
    /// KL(reference ‖ server) over the server's listed tokens and one rest bucket.
    pub kl: f64,
    /// The server's probability of the reference's top-1 minus the reference's.
    pub delta_p: f64,
    /// The largest |server − reference| log-probability among the listed tokens.
    pub max_abs_delta_logprob: f64,
    /// The reference's probability mass on the tokens the server listed.
    pub reference_mass: f64,
}

/// Where the server first parts from the reference, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Parting {
    pub position: usize,
    pub reason: String,
}

/// The server's top-k against the reference, over the prompt's positions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TopKComparison {
    pub positions: usize,
    /// The tolerance on a log-probability (nats) the partings were judged by.
    pub tolerance: f64,
    pub kl_mean: f64,
    pub kl_max: f64,
    pub top1_agreement: f64,
    pub delta_p_mean: f64,
    pub delta_p_min: f64,
    pub max_abs_delta_logprob: f64,
    /// Positions that part from the reference (`first_parting` is the first).
    pub parted: usize,
    pub first_parting: Option<Parting>,
    pub per_position: Vec<PositionDiff>,
}

/// Log-softmax of one row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .copied()
        .filter(|v| v.is_finite())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    let log_sum = sum.ln() + max;
    row.iter().map(|&v| f64::from(v) - log_sum).collect()
}

fn argmax(row: &[f64]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a)))
        .unwrap_or(0)
}

/// Compare `server` (per position, the listed `(id, log-probability)`, most probable first)
/// with the reference's `[positions, vocab]` logits; row `i` of the one belongs with entry `i`
/// of the other. An error: a position with nothing listed, or a token id past the vocabulary.
pub fn compare(
    reference: &[f32],
    vocab: usize,
    server: &[Vec<(u32, f64)>],
    tolerance: f64,
) -> Result<TopKComparison, String> {
    let rows = reference.len() / vocab.max(1);
    if rows != server.len() {
        return Err(format!(
            "{} reference positions, {} from the server",
            rows,
            server.len()
        ));
    }
    let mut per_position = Vec::with_capacity(rows);
    let mut first_parting = None;
    let mut parted = 0;
    for (t, listed) in server.iter().enumerate() {
        let lp = log_softmax(&reference[t * vocab..(t + 1) * vocab]);
        let Some(&(server_top1, _)) = listed.first() else {
            return Err(format!("position {t}: the server listed no token"));
        };
        if let Some(&(id, _)) = listed.iter().find(|(id, _)| *id as usize >= vocab) {
            return Err(format!(
                "position {t}: token id {id} is past the model's vocabulary of {vocab}"
            ));
        }
        let reference_top1 = argmax(&lp);
        let (mut p_listed, mut q_listed, mut kl, mut max_abs) = (0.0, 0.0, 0.0, 0.0f64);
        let mut non_finite = false;
        for &(id, q_lp) in listed {
            let p_lp = lp[id as usize];
            if q_lp.is_nan() || q_lp == f64::INFINITY {
                non_finite = true;
                continue;
            }
            let (p, q) = (p_lp.exp(), q_lp.exp());
            p_listed += p;
            q_listed += q;
            if p > 0.0 {
                kl += p * (p_lp - q_lp.max(f64::MIN_POSITIVE.ln()));
            }
            max_abs = max_abs.max((q_lp - p_lp).abs());
        }
        let (p_rest, q_rest) = ((1.0 - p_listed).max(0.0), (1.0 - q_listed).max(REST_FLOOR));
        if p_rest > 0.0 {
            kl += p_rest * (p_rest.ln() - q_rest.ln());
        }
        let (kl, max_abs) = if non_finite {
            (f64::INFINITY, f64::INFINITY)
        } else {
            (kl.max(0.0), max_abs)
        };
        let q_top1 = listed
            .iter()
            .find(|(id, _)| *id as usize == reference_top1)
            .map_or(0.0, |(_, q_lp)| q_lp.exp());
        let delta_p = q_top1 - lp[reference_top1].exp();
        let gap = lp[reference_top1] - lp[server_top1 as usize];
        let reason = if non_finite {
            Some("NaN or +Inf log-probability".to_string())
        } else if max_abs > tolerance {
            Some(format!(
                "|Δ logprob| {max_abs:.3} beyond the tolerance {tolerance}"
            ))
        } else if server_top1 as usize != reference_top1 && gap > tolerance {
            Some(format!(
                "top-1 {server_top1} where the reference's is {reference_top1} ({gap:.3} nats more likely)"
            ))
        } else {
            None
        };
        if let Some(reason) = reason {
            parted += 1;
            first_parting.get_or_insert(Parting {
                position: t,
                reason,
            });
        }
        per_position.push(PositionDiff {
            position: t,
            reference_top1: reference_top1 as u32,
            server_top1,
            kl,
            delta_p,
            max_abs_delta_logprob: max_abs,
            reference_mass: p_listed,
        });
    }
    let n = rows.max(1) as f64;
    let over = |f: fn(&PositionDiff) -> f64| per_position.iter().map(f);
    Ok(TopKComparison {
        positions: rows,
        tolerance,
        kl_mean: over(|d| d.kl).sum::<f64>() / n,
        kl_max: over(|d| d.kl).fold(0.0, f64::max),
        top1_agreement: per_position
            .iter()
            .filter(|d| d.server_top1 == d.reference_top1)
            .count() as f64
            / n,
        delta_p_mean: over(|d| d.delta_p).sum::<f64>() / n,
        delta_p_min: over(|d| d.delta_p).fold(0.0, f64::min),
        max_abs_delta_logprob: over(|d| d.max_abs_delta_logprob).fold(0.0, f64::max),
        parted,
        first_parting,
        per_position,
    })
}

/// The most one listed token adds to a [`fit`] score, in nats: a hypothesis that gives a token
/// no probability at all (or NaN) costs this much there, not an infinity that would hide how
/// well it fits everywhere else.
pub const FIT_CAP: f64 = 30.0;

/// How well a hypothesis's `[positions, vocab]` logits reproduce the server's listed
/// log-probabilities, as `(sum, terms)` so that several prompts pool into one mean.
///
/// The score of a hypothesis is `sum / terms`: the mean, over every position and every token
/// the server listed there, of `min(|logprob_hypothesis − logprob_server|, FIT_CAP)` in nats.
/// A term where exactly one side is not finite (a NaN, or −∞ against a finite value) counts
/// [`FIT_CAP`]; two equal infinities or two NaNs count 0. Lower is better, 0 a perfect fit. Only
/// listed tokens count: they are the only ones whose server log-probability is known.
pub fn fit(
    hypothesis: &[f32],
    vocab: usize,
    server: &[Vec<(u32, f64)>],
) -> Result<(f64, usize), String> {
    let rows = hypothesis.len() / vocab.max(1);
    if rows < server.len() {
        return Err(format!(
            "{rows} positions in the hypothesis's logits, {} from the server",
            server.len()
        ));
    }
    let (mut sum, mut terms) = (0.0, 0);
    for (t, listed) in server.iter().enumerate() {
        let lp = log_softmax(&hypothesis[t * vocab..(t + 1) * vocab]);
        for &(id, q) in listed {
            let Some(&p) = lp.get(id as usize) else {
                return Err(format!(
                    "position {t}: token id {id} is past the model's vocabulary of {vocab}"
                ));
            };
            sum += fit_term(p, q);
            terms += 1;
        }
    }
    Ok((sum, terms))
}

/// One listed token's term of [`fit`].
fn fit_term(hypothesis: f64, server: f64) -> f64 {
    if hypothesis.is_finite() && server.is_finite() {
        (hypothesis - server).abs().min(FIT_CAP)
    } else if (hypothesis.is_nan() && server.is_nan()) || hypothesis == server {
        0.0
    } else {
        FIT_CAP
    }
}

/// The server's health from its own answer: its top-1 probabilities against a uniform draw,
/// non-finite log-probabilities, and its greedy continuation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServerHealth {
    /// 1/V, V the model's vocabulary.
    pub uniform: f64,
    /// The server's top-1 probability, mean over the positions.
    pub top1_prob_mean: f64,
    /// The reference's, over the same positions.
    pub reference_top1_prob_mean: f64,
    /// The server's mean top-1 probability below [`FLAT_TOP1_TIMES_UNIFORM`]/V.
    pub flat: bool,
    /// NaN or +Inf log-probabilities the server listed.
    pub non_finite: u64,
    /// The longest run of one token in the server's continuation, and in the reference's.
    pub longest_repeat: usize,
    pub reference_longest_repeat: usize,
}

impl ServerHealth {
    pub fn of(
        server: &[Vec<(u32, f64)>],
        comparison: &TopKComparison,
        reference_logits: &[f32],
        vocab: usize,
        continuation: &[u32],
        reference_continuation: &[u32],
    ) -> ServerHealth {
        let n = server.len().max(1) as f64;
        let top1_prob_mean = server
            .iter()
            .filter_map(|l| l.first())
            .map(|(_, lp)| if lp.is_nan() { 0.0 } else { lp.exp() })
            .sum::<f64>()
            / n;
        let reference_top1_prob_mean = comparison
            .per_position
            .iter()
            .map(|d| {
                let row = &reference_logits[d.position * vocab..(d.position + 1) * vocab];
                log_softmax(row)[d.reference_top1 as usize].exp()
            })
            .sum::<f64>()
            / n;
        let uniform = 1.0 / vocab.max(1) as f64;
        ServerHealth {
            uniform,
            top1_prob_mean,
            reference_top1_prob_mean,
            flat: top1_prob_mean < FLAT_TOP1_TIMES_UNIFORM * uniform,
            non_finite: server
                .iter()
                .flatten()
                .filter(|(_, lp)| lp.is_nan() || *lp == f64::INFINITY)
                .count() as u64,
            longest_repeat: longest_run(continuation),
            reference_longest_repeat: longest_run(reference_continuation),
        }
    }
}

/// What makes the server's answer wrong, in words; empty when it agrees with the reference.
/// A flat distribution or a repeated token counts only where the reference's is not so.
pub fn problems(c: &TopKComparison, h: &ServerHealth) -> Vec<String> {
    let mut problems = Vec::new();
    if h.non_finite > 0 {
        problems.push(format!(
            "{} NaN or +Inf log-probabilities from the server",
            h.non_finite
        ));
    }
    let reference_flat = h.reference_top1_prob_mean < FLAT_TOP1_TIMES_UNIFORM * h.uniform;
    if h.flat && !reference_flat {
        problems.push(format!(
            "flat: the server's top-1 probability is {:.2}× 1/V (the reference's {:.2}×)",
            h.top1_prob_mean / h.uniform,
            h.reference_top1_prob_mean / h.uniform
        ));
    }
    if h.longest_repeat > MAX_REPEAT && h.reference_longest_repeat <= MAX_REPEAT {
        problems.push(format!(
            "one token {} times in a row in the server's continuation",
            h.longest_repeat
        ));
    }
    if c.top1_agreement < MIN_TOP1_AGREEMENT {
        problems.push(format!(
            "top-1 agrees with the reference at {:.1}% of positions",
            100.0 * c.top1_agreement
        ));
    }
    if let Some(p) = &c.first_parting {
        problems.push(format!(
            "parts from the reference at {} of {} positions, first at position {}: {}",
            c.parted, c.positions, p.position, p.reason
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fit_is_the_mean_capped_distance_over_listed_tokens() {
        let row = [2.0f32, 1.0, 0.0, -1.0];
        let exact = served(&row, 2, 0.0);
        let (sum, terms) = fit(&row, 4, std::slice::from_ref(&exact)).unwrap();
        assert_eq!(terms, 2);
        assert!(sum < 1e-9, "{sum}");
        let (sum, _) = fit(&row, 4, &[served(&row, 2, 0.25)]).unwrap();
        assert!((sum / 2.0 - 0.25).abs() < 1e-9, "{sum}");
        // A NaN hypothesis costs the cap per listed token, a shared −∞ nothing.
        let (sum, terms) = fit(&[f32::NAN; 4], 4, std::slice::from_ref(&exact)).unwrap();
        assert_eq!(sum / terms as f64, FIT_CAP);
        assert_eq!(fit_term(f64::NEG_INFINITY, f64::NEG_INFINITY), 0.0);
        assert_eq!(fit_term(-1.0, f64::NEG_INFINITY), FIT_CAP);
        assert!(fit(&row, 4, &[vec![(9, -1.0)]]).is_err());
    }

    /// The top `k` of `row` as a server lists them, each log-probability moved by `shift`.
    fn served(row: &[f32], k: usize, shift: f64) -> Vec<(u32, f64)> {
        let lp = log_softmax(row);
        let mut ids: Vec<usize> = (0..row.len()).collect();
        ids.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
        ids.iter()
            .take(k)
            .map(|&i| (i as u32, lp[i] + shift))
            .collect()
    }

    const ROWS: [f32; 12] = [
        2.0, 1.0, 0.5, -1.0, 0.0, 0.0, //
        -1.0, 3.0, 0.2, 0.1, 0.0, -2.0,
    ];

    #[test]
    fn the_reference_itself_agrees_everywhere() {
        let server: Vec<_> = ROWS.chunks(6).map(|r| served(r, 3, 0.0)).collect();
        let c = compare(&ROWS, 6, &server, DEFAULT_TOLERANCE).unwrap();
        assert!(c.kl_max < 1e-12 && c.max_abs_delta_logprob < 1e-12, "{c:?}");
        assert_eq!(
            (c.top1_agreement, c.parted, c.first_parting.clone()),
            (1.0, 0, None)
        );
        assert!(c.delta_p_min.abs() < 1e-12);
        let h = ServerHealth::of(&server, &c, &ROWS, 6, &[1, 2, 3], &[1, 2, 3]);
        assert!(!h.flat && h.non_finite == 0);
        assert!(problems(&c, &h).is_empty());
    }

    #[test]
    fn a_server_off_at_one_position_parts_there() {
        let mut server: Vec<_> = ROWS.chunks(6).map(|r| served(r, 3, 0.0)).collect();
        // Position 1: the server's top-1 is token 0, the reference's token 1.
        server[1] = vec![(0, -0.1), (1, -2.5), (2, -4.0)];
        let c = compare(&ROWS, 6, &server, DEFAULT_TOLERANCE).unwrap();
        let p = c.first_parting.clone().unwrap();
        assert_eq!(p.position, 1);
        assert_eq!(c.top1_agreement, 0.5);
        assert!(c.kl_max > 1.0 && c.per_position[1].delta_p < -0.5, "{c:?}");
        let h = ServerHealth::of(&server, &c, &ROWS, 6, &[], &[]);
        let words = problems(&c, &h);
        assert!(
            words.iter().any(|w| w.contains("first at position 1")),
            "{words:?}"
        );
    }

    #[test]
    fn a_small_shift_is_within_the_tolerance_and_the_kl_is_a_lower_bound() {
        let server: Vec<_> = ROWS.chunks(6).map(|r| served(r, 2, -0.05)).collect();
        let c = compare(&ROWS, 6, &server, DEFAULT_TOLERANCE).unwrap();
        assert!(c.first_parting.is_none());
        assert!((c.max_abs_delta_logprob - 0.05).abs() < 1e-9);
        assert!(c.kl_mean > 0.0 && c.kl_mean < 0.01, "{c:?}");
    }

    #[test]
    fn flat_nan_and_bad_ids_are_named() {
        let flat: Vec<_> = (0..2).map(|_| vec![(0u32, (1.0f64 / 6.0).ln())]).collect();
        let c = compare(&ROWS, 6, &flat, 10.0).unwrap();
        let h = ServerHealth::of(&flat, &c, &ROWS, 6, &[4; 6], &[1, 2, 3, 4, 5, 6]);
        assert!(h.flat && h.longest_repeat == 6);
        let words = problems(&c, &h);
        assert!(words.iter().any(|w| w.starts_with("flat")), "{words:?}");
        assert!(
            words.iter().any(|w| w.contains("6 times in a row")),
            "{words:?}"
        );
        let nan = vec![vec![(0u32, f64::NAN)], vec![(1, -0.1)]];
        let c = compare(&ROWS, 6, &nan, 10.0).unwrap();
        assert_eq!(c.first_parting.unwrap().position, 0);
        let past = vec![vec![(9u32, -0.1)], vec![(1, -0.1)]];
        assert!(compare(&ROWS, 6, &past, 1.0)
            .unwrap_err()
            .contains("past the model's vocabulary"));
    }
}
