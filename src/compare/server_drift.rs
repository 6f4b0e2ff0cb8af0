//! A server against itself: the same prompt's top-k log-probabilities asked alone and again
//! while other requests run beside it (`glmcheck endpoint --concurrency`). A correct server's
//! numbers for one request do not depend on what else it batches with it, beyond the rounding
//! of kernels that tile a batch differently; a server that lets requests see each other's
//! tokens, or whose kernels are wrong for some batch shapes, moves them by far more.
//!
//! Only tokens listed in both answers are compared: each answer's top-k can differ in its tail
//! without any log-probability moving.

use serde::Serialize;

/// The largest move between two answers of one prompt.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Drift {
    /// The largest |loaded − alone| log-probability of a token listed in both (nats); 0 where
    /// nothing is shared, +∞ where one side is not finite and the other is.
    pub max_abs_delta_logprob: f64,
    /// Where it is: the position, the token, its log-probability alone and beside others.
    pub at: Option<DriftAt>,
    /// Positions whose most probable token differs between the two answers.
    pub top1_changed: Vec<usize>,
    /// Positions compared.
    pub positions: usize,
}

/// One token's two log-probabilities.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DriftAt {
    pub position: usize,
    pub token: u32,
    pub alone: f64,
    pub beside_others: f64,
}

/// How far `loaded` moved from `alone` (per position, `(id, log-probability)` lists, the most
/// probable first); positions past the shorter of the two are not compared.
pub fn drift(alone: &[Vec<(u32, f64)>], loaded: &[Vec<(u32, f64)>]) -> Drift {
    let mut worst = Drift {
        max_abs_delta_logprob: 0.0,
        at: None,
        top1_changed: Vec::new(),
        positions: alone.len().min(loaded.len()),
    };
    for (position, (a, b)) in alone.iter().zip(loaded).enumerate() {
        if let (Some(x), Some(y)) = (a.first(), b.first()) {
            if x.0 != y.0 {
                worst.top1_changed.push(position);
            }
        }
        for &(token, lp_alone) in a {
            let Some(&(_, lp_loaded)) = b.iter().find(|(id, _)| *id == token) else {
                continue;
            };
            let delta = delta(lp_alone, lp_loaded);
            if delta > worst.max_abs_delta_logprob {
                worst.max_abs_delta_logprob = delta;
                worst.at = Some(DriftAt {
                    position,
                    token,
                    alone: lp_alone,
                    beside_others: lp_loaded,
                });
            }
        }
    }
    worst
}

/// |a − b|, 0 for two equal infinities or two NaNs, +∞ where only one side is finite.
fn delta(a: f64, b: f64) -> f64 {
    if a.is_finite() && b.is_finite() {
        (a - b).abs()
    } else if a == b || (a.is_nan() && b.is_nan()) {
        0.0
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_move_of_a_shared_token_is_found_and_tail_changes_are_not_moves() {
        let alone = vec![vec![(3, -0.1), (5, -2.5), (8, -4.0)], vec![(9, -0.2)]];
        // Position 0: token 8 left the top-k, 7 came in (no move); 5 moved by 0.3.
        // Position 1: the top-1 changed, and 9 moved by 1.8.
        let loaded = vec![
            vec![(3, -0.1), (5, -2.2), (7, -3.9)],
            vec![(4, -0.3), (9, -2.0)],
        ];
        let d = drift(&alone, &loaded);
        assert_eq!(d.positions, 2);
        assert!((d.max_abs_delta_logprob - 1.8).abs() < 1e-12);
        let at = d.at.unwrap();
        assert_eq!((at.position, at.token), (1, 9));
        assert_eq!((at.alone, at.beside_others), (-0.2, -2.0));
        assert_eq!(d.top1_changed, vec![1]);
    }

    #[test]
    fn identical_answers_do_not_move_and_a_nan_on_one_side_is_infinite() {
        let a = vec![vec![(1, -0.5), (2, f64::NEG_INFINITY)]];
        let d = drift(&a, &a);
        assert_eq!((d.max_abs_delta_logprob, d.at.clone()), (0.0, None));
        let nan = vec![vec![(1, f64::NAN), (2, f64::NEG_INFINITY)]];
        assert_eq!(drift(&a, &nan).max_abs_delta_logprob, f64::INFINITY);
        assert_eq!(drift(&nan, &nan).max_abs_delta_logprob, 0.0);
    }
}
