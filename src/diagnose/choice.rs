//! What the explanations of another top-k choice share: the divergent layer they explain, how
//! a hypothesis's choices hold the candidate's, and how the hypotheses that fit are named.

use crate::compare::classify::NEAR_TIE;
use crate::compare::{DiffReport, Fault, FaultClass};
use crate::model::Stage;

/// The layer of a first divergence at a stage of one of `kinds` whose fault is of `class`, and
/// that fault, to explain further.
pub(super) fn divergent_fault<'a>(
    report: &'a mut DiffReport,
    kinds: &[&str],
    class: FaultClass,
) -> Option<(u64, &'a mut Fault)> {
    let l = Stage::parse(&report.first_divergence.as_ref()?.stage)
        .filter(|s| kinds.contains(&s.kind()))
        .and_then(|s| s.layer())?;
    let fault = report.fault.as_mut().filter(|f| f.class == class)?;
    Some((l, fault))
}

/// A hypothesis's choice at every position: the ids chosen, and how close it came to a tie
/// (its k-th score minus the best unchosen one; negative where every candidate is chosen).
pub(super) struct Choices {
    pub ids: Vec<Vec<i64>>,
    pub gaps: Vec<f32>,
}

/// How a hypothesis's choices hold a recorded `[t, k]` choice: the positions where they are
/// the same set, and those where they differ only at a near tie, which a run at a lower
/// precision may break the other way: the hypothesis's own, or the reference's (`ties`, what
/// bisect took as the reference's near ties at the candidate's dtype).
pub(super) struct Fit {
    pub same: usize,
    pub near_ties: usize,
}

impl Choices {
    pub fn fit(&self, recorded: &[f32], k: usize, ties: Option<&dyn Fn(usize) -> bool>) -> Fit {
        let largest = self.gaps.iter().copied().fold(0f32, f32::max);
        let near = |p: usize, g: f32| match ties {
            Some(reference) => {
                (g >= 0.0 && f64::from(g) <= NEAR_TIE * f64::from(largest)) || reference(p)
            }
            None => false,
        };
        let mut fit = Fit {
            same: 0,
            near_ties: 0,
        };
        for (p, (ids, &gap)) in self.ids.iter().zip(&self.gaps).enumerate() {
            let mut theirs: Vec<i64> = recorded[p * k..(p + 1) * k]
                .iter()
                .map(|&i| i as i64)
                .collect();
            theirs.sort_unstable();
            let mut ours = ids.clone();
            ours.sort_unstable();
            if ours == theirs {
                fit.same += 1;
            } else if near(p, gap) {
                fit.near_ties += 1;
            }
        }
        fit
    }
}

impl Fit {
    /// Every one of `t` positions held, the differing ones only at near ties.
    pub fn holds(&self, t: usize) -> bool {
        self.same + self.near_ties == t
    }

    /// Where the positions held, in words ("all 9 positions", "7 of 9 positions and the other 2
    /// at near ties").
    pub fn positions(&self, t: usize) -> String {
        match self.near_ties {
            0 => format!("all {t} positions"),
            n => format!(
                "{} of {t} positions and the other {n} at near ties, which the candidate's \
                 precision may break either way",
                self.same
            ),
        }
    }
}

/// The hypotheses that each give the candidate's choice, as one phrase: the one, or all named
/// together where this prompt does not tell them apart (none preferred); none, no phrase.
pub(super) fn named_together(fits: &[&str]) -> Option<String> {
    match fits {
        [] => None,
        [one] => Some(one.to_string()),
        _ => Some(format!(
            "{} (this prompt does not tell them apart)",
            fits.join(", or with ")
        )),
    }
}
