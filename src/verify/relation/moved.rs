//! Departures that are the reference's own values somewhere else: another tensor's bytes,
//! another expert's, rows or heads in another order, a transpose, swapped halves.

use std::collections::HashMap;

use anyhow::Result;

use super::{Departure, Finding, Relation};
use crate::model::names::{LayerWeight, WeightId};
use crate::model::schema::role;
use crate::rng::SplitMix;
use crate::trace::stats::fnv1a_bytes;
use crate::verify::segments::{compare, restore, BAND, SEGMENT};
use crate::verify::units::{both, candidate_bytes, candidate_values, plan, reference_values, Unit};
use crate::weights::GgmlType;

impl Departure<'_> {
    /// Departing rows that are byte for byte rows of another tensor of the candidate.
    pub(super) fn other_tensor(&self) -> Result<Option<Finding>> {
        let t = self.t();
        let Some(ty) = self.ty() else {
            return Ok(None);
        };
        let Some(row_bytes) = ty.bytes_for(t.row_len()) else {
            return Ok(None);
        };
        let rows = self.departing_rows(64);
        if rows.is_empty() {
            return Ok(None);
        }
        let bytes = self.cand.files.bytes(t);
        let row = |b: &[u8], r: u64| -> Option<u64> {
            let s = (r * row_bytes) as usize;
            Some(fnv1a_bytes(b.get(s..s + row_bytes as usize)?))
        };
        let wanted: HashMap<u64, u64> = rows
            .iter()
            .filter_map(|&r| Some((row(bytes, r)?, r)))
            .collect();
        let mut found: Vec<(u64, String, u64)> = Vec::new();
        for other in self.cand.files.tensors() {
            if other.name == t.name
                || other.encoding != t.encoding
                || other.row_len() != t.row_len()
            {
                continue;
            }
            let ob = self.cand.files.bytes(other);
            for r in 0..other.rows() {
                if let Some(&mine) = row(ob, r).and_then(|h| wanted.get(&h)) {
                    found.push((mine, other.name.clone(), r));
                }
            }
            if found.len() >= wanted.len() {
                break;
            }
        }
        let Some((_, source, _)) = found.first().cloned() else {
            return Ok(None);
        };
        let mut from: Vec<(u64, u64)> = found
            .iter()
            .filter(|f| f.1 == source)
            .map(|f| (f.0, f.2))
            .collect();
        from.sort_unstable();
        from.dedup_by_key(|p| p.0);
        if from.len() < wanted.len() {
            return Ok(None);
        }
        let (first, last) = (from[0], from[from.len() - 1]);
        let mut f = self.finding(
            Relation::OtherTensor,
            format!(
                "{}: departing rows are byte for byte rows of {source}",
                t.name
            ),
            vec![format!(
                "{}: rows {}..={} ({} rows) hold the stored bytes of {source}'s rows {}..={}",
                t.name,
                first.0,
                last.0,
                from.len(),
                first.1,
                last.1
            )],
        );
        f.map = from;
        Ok(Some(f))
    }

    /// The reference's values of a sibling: another tensor of the candidate with this one's
    /// shape in the same layer, whose reference values the first departing units hold within
    /// the band. Checked the other way too, to tell a swap from a copy.
    pub(super) fn other_weight(&self) -> Result<Option<Finding>> {
        let t = self.t();
        let layer = self.plan.id.layer();
        let departing: Vec<&Unit> = self.departing().take(4).map(|(u, _)| u).collect();
        if departing.is_empty() {
            return Ok(None);
        }
        let family = self.cand.layout().family;
        for other in self.cand.files.tensors() {
            // Another expert of the same role is an expert permutation, tried next.
            let same_role_expert = |id: WeightId| match (id, self.plan.id) {
                (WeightId::Expert { which: a, .. }, WeightId::Expert { which: b, .. }) => a == b,
                _ => false,
            };
            let sibling = other.name != t.name
                && other.shape == t.shape
                && role(family, &other.name)
                    .is_some_and(|id| id.layer() == layer && !same_role_expert(id));
            if !sibling {
                continue;
            }
            let Ok(theirs) = plan(self.reference, self.cand, other) else {
                continue;
            };
            let same_rows = |u: &Unit| theirs.units.iter().find(|o| o.rows == u.rows);
            let mut holds_theirs = true;
            for u in &departing {
                let Some(o) = same_rows(u) else {
                    holds_theirs = false;
                    break;
                };
                let x = reference_values(self.reference, o)?;
                let c = candidate_values(self.cand, t, u)?;
                if x.len() != c.len() || !self.holds(&x, &c, candidate_bytes(self.cand, t, u))? {
                    holds_theirs = false;
                    break;
                }
            }
            if !holds_theirs {
                continue;
            }
            // Whether the other tensor holds this one's reference values in turn.
            let u = departing[0];
            let swapped = match same_rows(u) {
                Some(o) => {
                    let x = reference_values(self.reference, u)?;
                    let c = candidate_values(self.cand, other, o)?;
                    let stored = candidate_bytes(self.cand, other, o);
                    x.len() == c.len()
                        && compare(self.ty(), self.row_len(), &x, &c, stored, false)
                            .is_ok_and(|st| st.beyond == 0 && st.nonfinite == 0)
                }
                None => false,
            };
            let (summary, how) = match swapped {
                true => (
                    format!("{} and {}: swapped", t.name, other.name),
                    format!("and {} holds the reference's {}", other.name, t.name),
                ),
                false => (
                    format!("{} holds the reference's {}", t.name, other.name),
                    format!("{} is not this tensor's values either", other.name),
                ),
            };
            let mut f = self.finding(
                Relation::OtherWeight,
                summary,
                vec![format!(
                    "{}: {} hold the reference's {} within {}'s noise; {how}",
                    t.name,
                    self.share(),
                    other.name,
                    self.type_name()
                )],
            );
            f.with = Some(other.name.clone());
            return Ok(Some(f));
        }
        Ok(None)
    }

    /// Rows (of the whole tensor) of the first departing segments, at most `most`.
    pub(super) fn departing_rows(&self, most: usize) -> Vec<u64> {
        let row_len = self.row_len().max(1);
        let mut rows: Vec<u64> = self
            .departing()
            .flat_map(|(u, s)| {
                s.first_beyond.iter().flat_map(move |b| {
                    let first = b.at / row_len;
                    let last = (b.at + SEGMENT - 1) / row_len;
                    (first..=last).map(move |r| u.rows.start + r as u64)
                })
            })
            .filter(|&r| r < self.t().rows())
            .collect();
        rows.sort_unstable();
        rows.dedup();
        rows.truncate(most);
        rows
    }

    /// Whether `c` (a unit's candidate values) is, within the band, the reference's `x`.
    pub(super) fn holds(&self, x: &[f32], c: &[f32], stored: Option<&[u8]>) -> Result<bool> {
        let st = compare(self.ty(), self.row_len(), x, c, stored, false)?;
        Ok(st.beyond == 0 && st.nonfinite == 0)
    }

    /// Departing experts that are other experts of the reference.
    pub(super) fn experts(&self) -> Result<Option<Finding>> {
        if let WeightId::Expert {
            layer,
            expert,
            which,
        } = self.plan.id
        {
            return self.other_expert(layer, expert, which);
        }
        let units = &self.plan.units;
        if units.len() < 2 || units[0].expert.is_none() {
            return Ok(None);
        }
        let mut map = Vec::new();
        for (u, _) in self.departing() {
            let e = u.expert.unwrap_or(0);
            let c = candidate_values(self.cand, self.t(), u)?;
            let stored = candidate_bytes(self.cand, self.t(), u);
            let mut matched = None;
            for other in units.iter().filter(|o| o.expert != u.expert) {
                let x = reference_values(self.reference, other)?;
                if x.len() == c.len() && self.holds(&x, &c, stored)? {
                    matched = other.expert;
                    break;
                }
            }
            match matched {
                Some(m) => map.push((e, m)),
                None => return Ok(None),
            }
        }
        let moved: Vec<String> = map
            .iter()
            .map(|(e, m)| format!("expert {e} holds the reference's expert {m}"))
            .collect();
        let mut f = self.finding(
            Relation::ExpertPermutation,
            format!(
                "{}: {} of {} experts hold other experts' weights",
                self.t().name,
                map.len(),
                units.len()
            ),
            vec![format!(
                "{}: {}; each within {}'s noise of the expert it holds; every other expert is in \
                 place",
                self.t().name,
                moved.join(", "),
                self.type_name()
            )],
        );
        f.map = map;
        Ok(Some(f))
    }

    /// An expert stored as a tensor of its own (a Hugging Face checkpoint's per-expert layout)
    /// that holds another expert of the reference: the first whose values it holds within the
    /// band, trying each of the layer's experts.
    pub(super) fn other_expert(
        &self,
        layer: u64,
        expert: u64,
        which: LayerWeight,
    ) -> Result<Option<Finding>> {
        let [u] = &self.plan.units[..] else {
            return Ok(None);
        };
        let c = candidate_values(self.cand, self.t(), u)?;
        let stored = candidate_bytes(self.cand, self.t(), u);
        for other in (0..self.reference.cfg.n_routed_experts).filter(|&e| e != expert) {
            let x = self
                .reference
                .expert_matrix(layer, other, which)?
                .into_data();
            if x.len() != c.len() || !self.holds(&x, &c, stored)? {
                continue;
            }
            let mut f = self.finding(
                Relation::ExpertPermutation,
                format!(
                    "{}: expert {expert} holds another expert's weights",
                    self.t().name
                ),
                vec![format!(
                    "{}: layer {layer}'s expert {expert} holds the reference's expert {other} \
                     (within {}'s noise)",
                    self.t().name,
                    self.type_name()
                )],
            );
            f.map = vec![(expert, other)];
            return Ok(Some(f));
        }
        Ok(None)
    }

    /// Departing rows of a unit that are other rows of the reference: heads where the rows of
    /// each head moved together, else rows.
    pub(super) fn rows(&self) -> Result<Option<Finding>> {
        let row_len = self.row_len();
        let mut map: Vec<(u64, u64)> = Vec::new();
        for (u, _) in self.departing().take(4) {
            let (x, c) = both(self.reference, self.cand, self.t(), u)?;
            match moved_rows(self.ty(), row_len, &x, &c)? {
                Some(moved) => map.extend(
                    moved
                        .into_iter()
                        .map(|(r, o)| (u.rows.start + r as u64, u.rows.start + o as u64)),
                ),
                None => return Ok(None),
            }
        }
        if map.is_empty() {
            return Ok(None);
        }
        let name = &self.t().name;
        if let Some(heads) = self.plan.head_rows.and_then(|hr| head_map(&map, hr)) {
            let shown: Vec<String> = heads
                .iter()
                .map(|(h, o)| format!("head {h} holds the reference's head {o}"))
                .collect();
            let mut f = self.finding(
                Relation::HeadPermutation,
                format!("{name}: attention heads in another order"),
                vec![format!(
                    "{name}: {} ({} rows a head); every row within {}'s noise of the row it holds",
                    shown.join(", "),
                    self.plan.head_rows.unwrap_or(0),
                    self.type_name()
                )],
            );
            f.map = heads;
            return Ok(Some(f));
        }
        let shown: Vec<String> = map
            .iter()
            .take(4)
            .map(|(r, o)| format!("row {r} is the reference's row {o}"))
            .collect();
        let mut f = self.finding(
            Relation::RowPermutation,
            format!("{name}: the reference's rows in another order"),
            vec![format!(
                "{name}: {} rows moved ({}{}); each within {}'s noise of the row it holds",
                map.len(),
                shown.join(", "),
                if map.len() > 4 { ", …" } else { "" },
                self.type_name()
            )],
        );
        f.map = map;
        Ok(Some(f))
    }

    /// A transpose (per head of a 3-D tensor) or the two halves of every row swapped.
    pub(super) fn rearranged(&self) -> Result<Option<Finding>> {
        let t = self.t();
        let [u] = &self.plan.units[..] else {
            return Ok(None);
        };
        let (x, c) = both(self.reference, self.cand, t, u)?;
        let (slices, a, b) = match t.shape[..] {
            [h, a, b] => (h as usize, a as usize, b as usize),
            [a, b] if a == b => (1, a as usize, b as usize),
            _ => (0, 0, 0),
        };
        let name = &t.name;
        if slices > 0 && a * b * slices == x.len() {
            // The reference's [a, b] slices read column by column, stored in the same shape.
            let mut xt = vec![0f32; x.len()];
            for s in 0..slices {
                let (src, dst) = (&x[s * a * b..][..a * b], &mut xt[s * a * b..][..a * b]);
                for i in 0..a {
                    for j in 0..b {
                        dst[j * a + i] = src[i * b + j];
                    }
                }
            }
            if self.holds(&xt, &c, None)? {
                let per = if slices > 1 { " per head" } else { "" };
                return Ok(Some(self.finding(
                    Relation::Transpose,
                    format!("{name}: the reference's values transposed{per}"),
                    vec![format!(
                        "{name}: each [{a}, {b}] slice holds the reference's slice transposed \
                         (as a converter that skips attn_k_b's per-head transpose writes it); \
                         within {}'s noise",
                        self.type_name()
                    )],
                )));
            }
        }
        let row_len = self.row_len();
        if row_len >= 2 && row_len.is_multiple_of(2) {
            let half = row_len / 2;
            let swapped: Vec<f32> = x
                .chunks(row_len)
                .flat_map(|r| r[half..].iter().chain(&r[..half]).copied())
                .collect();
            if self.holds(&swapped, &c, None)? {
                return Ok(Some(self.finding(
                    Relation::SwappedHalves,
                    format!("{name}: the two halves of every row swapped"),
                    vec![format!(
                        "{name}: columns 0..{half} hold the reference's columns {half}..{row_len} \
                         and the reverse, within {}'s noise",
                        self.type_name()
                    )],
                )));
            }
        }
        Ok(None)
    }
}

/// For each row of `c` that departs from the same row of `x`, the other row of `x` it holds
/// (within the band of `ty`'s noise); `None` when some departing row holds no row of `x`.
pub fn moved_rows(
    ty: Option<GgmlType>,
    row_len: usize,
    x: &[f32],
    c: &[f32],
) -> Result<Option<Vec<(usize, usize)>>> {
    let rows = x.len() / row_len.max(1);
    if rows < 2 || c.len() != x.len() {
        return Ok(None);
    }
    let noise = row_noise(ty, row_len, x)?;
    let sketch_x = sketches(x, row_len);
    let sketch_c = sketches(c, row_len);
    let mut moved = Vec::new();
    for r in 0..rows {
        let (xr, cr) = (&x[r * row_len..][..row_len], &c[r * row_len..][..row_len]);
        if within(xr, cr, noise[r]) {
            continue;
        }
        let best = (0..rows)
            .filter(|&o| o != r)
            .min_by(|&a, &b| {
                distance(&sketch_c[r], &sketch_x[a])
                    .total_cmp(&distance(&sketch_c[r], &sketch_x[b]))
            })
            .filter(|&o| within(&x[o * row_len..][..row_len], cr, noise[o]));
        match best {
            Some(o) => moved.push((r, o)),
            None => return Ok(None),
        }
    }
    Ok(Some(moved))
}

/// Per row, the noise Σ(x−q)² storing it in `ty` leaves (0 without a quantizer: exact rows).
fn row_noise(ty: Option<GgmlType>, row_len: usize, x: &[f32]) -> Result<Vec<f64>> {
    let restored = match ty {
        Some(ty) => restore(ty, row_len, x)?,
        None => None,
    };
    Ok(match restored {
        Some((q, _)) => x
            .chunks(row_len)
            .zip(q.chunks(row_len))
            .map(|(xr, qr)| {
                xr.iter()
                    .zip(qr)
                    .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
                    .sum()
            })
            .collect(),
        None => x
            .chunks(row_len)
            .map(|r| 1e-4 * r.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>())
            .collect(),
    })
}

/// Whether row `c` is row `x` within the band over `noise`.
fn within(x: &[f32], c: &[f32], noise: f64) -> bool {
    let (mut dd, mut xx) = (0.0, 0.0);
    for (&a, &b) in x.iter().zip(c) {
        let (a, b) = (f64::from(a), f64::from(b));
        dd += (a - b) * (a - b);
        xx += a * a;
    }
    dd <= BAND * noise + 1e-12 * xx + f64::from(f32::MIN_POSITIVE)
}

/// Projections of each row on 8 fixed random ±1 directions: rows close in values are close here.
fn sketches(v: &[f32], row_len: usize) -> Vec<[f64; 8]> {
    let mut rng = SplitMix::new(0x5eed);
    let signs: Vec<[f64; 8]> = (0..row_len)
        .map(|_| std::array::from_fn(|_| if rng.next_u64() & 1 == 0 { 1.0 } else { -1.0 }))
        .collect();
    v.chunks(row_len)
        .map(|row| {
            let mut s = [0f64; 8];
            for (x, sg) in row.iter().zip(&signs) {
                for k in 0..8 {
                    s[k] += f64::from(*x) * sg[k];
                }
            }
            s
        })
        .collect()
}

fn distance(a: &[f64; 8], b: &[f64; 8]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// The heads map when every moved row moved by whole heads to the same place within its head.
pub(super) fn head_map(rows: &[(u64, u64)], head_rows: u64) -> Option<Vec<(u64, u64)>> {
    let mut heads: Vec<(u64, u64)> = Vec::new();
    for &(r, o) in rows {
        if r % head_rows != o % head_rows {
            return None;
        }
        let pair = (r / head_rows, o / head_rows);
        match heads.iter().find(|p| p.0 == pair.0) {
            Some(p) if p.1 != pair.1 => return None,
            Some(_) => {}
            None => heads.push(pair),
        }
    }
    Some(heads)
}
