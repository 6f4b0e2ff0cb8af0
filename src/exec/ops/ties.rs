//! Near ties at a top-k boundary, resolved as the reference resolved them.
//!
//! Where the reference's k-th DSA or router score is within [`NEAR_TIE`] of the best unchosen
//! one (relative to the layer's largest gap), a run at a lower precision may choose the other
//! key or expert: not a bug, yet its effect grows through every later stage. A candidate run
//! given these tie-breaks takes the reference's choice at exactly those positions — so what
//! still diverges is not a tie — and the diagnosis says how many it took.
//!
//! Given the reference re-run at the candidate's dtype (the envelope), a gap is also a near tie
//! when it is within [`NOISE_FACTOR`] times the most that dtype moved any gap of the layer: the
//! choice scores of another engine at that dtype carry noise of that size (its GEMMs sum in
//! another order), so a smaller gap may flip without any bug.

use std::collections::BTreeMap;

use anyhow::Result;

use crate::compare::classify::NEAR_TIE;

/// How many times the envelope's largest gap departure counts as noise: another engine at the
/// same dtype rounds differently from glmcheck's emulation, by about as much again.
pub const NOISE_FACTOR: f64 = 2.0;
use crate::compare::stage_diff::whole_values;
use crate::model::Stage;
use crate::trace::Trace;

/// Per layer, per prompt position: the reference's choice where it was a near tie.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TieBreaks {
    pub dsa: BTreeMap<u64, Vec<Option<Vec<i32>>>>,
    pub moe: BTreeMap<u64, Vec<Option<Vec<i32>>>>,
}

/// The largest departure of the envelope's gap from the reference's at the positions where both
/// chose the same set (a different set has an unrelated gap).
fn gap_noise(
    envelope: &Trace,
    ids_stage: &str,
    gap_stage: &str,
    (ids, gaps): (&[f32], &[f32]),
    k: usize,
) -> Result<f64> {
    let (Some((env_ids, _)), Some((env_gaps, _))) = (
        whole_values(envelope, ids_stage)?,
        whole_values(envelope, gap_stage)?,
    ) else {
        return Ok(0.0);
    };
    let set = |row: &[f32]| {
        let mut s: Vec<i64> = row.iter().map(|&v| v as i64).collect();
        s.sort_unstable();
        s
    };
    Ok(gaps
        .iter()
        .zip(&env_gaps)
        .zip(ids.chunks(k).zip(env_ids.chunks(k)))
        .filter(|((&g, &e), (a, b))| g >= 0.0 && e >= 0.0 && set(a) == set(b))
        .map(|((&g, &e), _)| f64::from((g - e).abs()))
        .fold(0.0, f64::max))
}

impl TieBreaks {
    /// The near ties of a reference trace that holds its top-k ids and gaps in full.
    pub fn from_trace(reference: &Trace) -> Result<TieBreaks> {
        Self::from_traces(reference, None)
    }

    /// The near ties of `reference`, with gaps within the noise the `envelope` run shows at the
    /// candidate's dtype counted as ties too.
    pub fn from_traces(reference: &Trace, envelope: Option<&Trace>) -> Result<TieBreaks> {
        let mut ties = TieBreaks::default();
        for s in reference.stages() {
            let Some(stage) = Stage::parse(&s.name) else {
                continue;
            };
            let map = match stage.kind() {
                "attn.index_topk" => &mut ties.dsa,
                "moe.topk_ids" => &mut ties.moe,
                _ => continue,
            };
            let (Some(layer), Some(gap_stage)) = (stage.layer(), stage.gaps()) else {
                continue;
            };
            let gap_stage = gap_stage.to_string();
            let (Some((ids, shape)), Some((gaps, _))) = (
                whole_values(reference, &s.name)?,
                whole_values(reference, &gap_stage)?,
            ) else {
                continue;
            };
            let k = shape.last().copied().unwrap_or(1).max(1) as usize;
            let largest = gaps.iter().copied().fold(0f32, f32::max);
            let noise = match envelope {
                Some(env) => gap_noise(env, &s.name, &gap_stage, (&ids, &gaps), k)?,
                None => 0.0,
            };
            let limit = (NEAR_TIE * f64::from(largest)).max(NOISE_FACTOR * noise);
            let near: Vec<Option<Vec<i32>>> = gaps
                .iter()
                .zip(ids.chunks(k))
                .map(|(&gap, row)| {
                    (gap >= 0.0 && f64::from(gap) <= limit)
                        .then(|| row.iter().map(|&v| v as i32).collect())
                })
                .collect();
            if near.iter().any(Option::is_some) {
                map.insert(layer, near);
            }
        }
        Ok(ties)
    }

    /// The same near-tie positions with `other`'s choices there, where `other` (an engine's
    /// trace) holds its top-k ids in full: for a reference run that follows the engine's
    /// tie-breaking at exactly the positions where the reference itself found a near tie.
    pub fn chosen_by(&self, other: &Trace) -> Result<TieBreaks> {
        let mut out = TieBreaks::default();
        for (map, from, stage) in [
            (&self.dsa, &mut out.dsa, "attn.index_topk"),
            (&self.moe, &mut out.moe, "moe.topk_ids"),
        ] {
            for (&l, positions) in map {
                let Some((ids, shape)) =
                    whole_values(other, &Stage::layer_stage(l, stage).to_string())?
                else {
                    continue;
                };
                let k = shape.last().copied().unwrap_or(1).max(1) as usize;
                let rows: Vec<&[f32]> = ids.chunks(k).collect();
                let theirs = positions
                    .iter()
                    .enumerate()
                    .map(|(p, tie)| {
                        let row = rows.get(p).filter(|_| tie.is_some())?;
                        Some(row.iter().map(|&v| v as i32).collect())
                    })
                    .collect();
                from.insert(l, theirs);
            }
        }
        Ok(out)
    }

    /// Every choice of `other` taken here too (where both give one, `other`'s).
    pub fn absorb(&mut self, other: &TieBreaks) {
        for (mine, theirs) in [(&mut self.dsa, &other.dsa), (&mut self.moe, &other.moe)] {
            for (&l, positions) in theirs {
                let at = mine.entry(l).or_default();
                if at.len() < positions.len() {
                    at.resize(positions.len(), None);
                }
                for (p, choice) in positions.iter().enumerate() {
                    if choice.is_some() {
                        at[p] = choice.clone();
                    }
                }
            }
        }
    }

    /// How many positions choose another set of ids in `other` than here.
    pub fn differing(&self, other: &TieBreaks) -> usize {
        let set = |v: &[i32]| {
            let mut s = v.to_vec();
            s.sort_unstable();
            s
        };
        let mut n = 0;
        for (mine, theirs) in [(&self.dsa, &other.dsa), (&self.moe, &other.moe)] {
            for (l, positions) in mine {
                for (p, tie) in positions.iter().enumerate() {
                    let other = theirs
                        .get(l)
                        .and_then(|t| t.get(p))
                        .and_then(Option::as_ref);
                    if let (Some(a), Some(b)) = (tie, other) {
                        n += usize::from(set(a) != set(b));
                    }
                }
            }
        }
        n
    }

    /// How many positions take the reference's choice.
    pub fn count(&self) -> usize {
        self.dsa
            .values()
            .chain(self.moe.values())
            .flatten()
            .filter(|c| c.is_some())
            .count()
    }

    /// The reference's choice at `position` of layer `l`, if that was a near tie.
    pub fn dsa_at(&self, l: u64, position: usize) -> Option<&[i32]> {
        self.dsa.get(&l)?.get(position)?.as_deref()
    }

    pub fn moe_at(&self, l: u64, position: usize) -> Option<&[i32]> {
        self.moe.get(&l)?.get(position)?.as_deref()
    }
}
