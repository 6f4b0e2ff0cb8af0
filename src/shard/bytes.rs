//! Quantized shards (manifest version 2): what a rank holds of a GGUF tensor as the file's raw
//! GGML blocks, as vLLM's `GGUFConfig` keeps them. Identified byte for byte: the shard's FNV-1a
//! 64 against the same hash over each slice of the file tensor's bytes — the plan's rows or
//! byte columns for every rank, the whole tensor, and the range the engine says it took — so
//! any quant type is checked exactly, with no dequantization.
//!
//! A split along a row's elements is a split of its bytes only where it falls on a block
//! boundary. Where the plan's columns start or end inside a block (a RowParallel weight whose
//! per-rank width is not a multiple of the type's block), no rank can hold its share as whole
//! blocks: vLLM's loader then cuts each row's bytes evenly anyway, and the verdict is
//! `wrong_shard_layout` naming the tensor, the rank, the block and the byte offset.

use std::ops::Range;

use anyhow::{anyhow, bail, Result};

use super::manifest::{EngineDequant, ShardEntry};
use super::plan::{placement, Placement};
use crate::compare::fault::FaultClass;
use crate::model::names::WeightId;
use crate::trace::stats::fnv1a_pieces;
use crate::weights::ggml_type::GgmlType;
use crate::weights::quant;
use crate::weights::tensor::{Encoding, TensorEntry};
use crate::weights::ModelFiles;

/// Rows (of each outer index: expert) and byte columns of a tensor's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    pub rows: Range<u64>,
    pub cols: Range<u64>,
}

/// What one rank says it holds of a quantized weight.
pub struct QuantShard<'e> {
    pub rank: u64,
    pub ggml_type: &'e str,
    /// The bytes' shape as held: `[rows, bytes]` or `[experts, rows, bytes]`.
    pub shape: &'e [u64],
    pub hash: u64,
    /// The region the engine says it took the bytes from.
    pub source: Option<Region>,
    /// What the engine's dequantization op made of the bytes, if the manifest says.
    pub dequant: Option<&'e EngineDequant>,
}

impl<'e> QuantShard<'e> {
    /// A quantized manifest entry of `rank` as the byte identifier sees it.
    pub fn of(entry: &'e ShardEntry, rank: u64) -> Self {
        QuantShard {
            rank,
            ggml_type: entry.ggml_type.as_deref().unwrap_or(""),
            shape: &entry.shape,
            hash: entry.hash.map_or(0, |h| h.0),
            source: entry.source.as_ref().map(|s| Region {
                rows: s.rows[0]..s.rows[1],
                cols: s.byte_cols[0]..s.byte_cols[1],
            }),
            dequant: entry.dequant.as_ref(),
        }
    }
}

/// The engine's dequantization of a shard, checked against ggml's (a mismatch is a
/// `wrong_dequant` verdict instead).
#[derive(Clone, Debug, PartialEq)]
pub enum DequantCheck {
    /// The same values bit for bit, in the engine's dtype.
    Equal { op: String },
    /// Not compared: the op is absent from the engine's build, or the bytes are not whole blocks.
    NotRun { op: String, why: String },
}

/// One rank's quantized shard, judged.
pub struct ByteVerdict {
    pub rank: u64,
    pub expected: String,
    pub found: Option<String>,
    pub class: Option<FaultClass>,
    pub evidence: String,
    pub dequant: Option<DequantCheck>,
}

/// A GGUF tensor's bytes seen as `[outer, rows, row_bytes]`.
struct Stored<'a> {
    name: &'a str,
    data: &'a [u8],
    ty: GgmlType,
    outer: u64,
    rows: u64,
    row_len: u64,
    row_bytes: u64,
}

impl<'a> Stored<'a> {
    fn new(files: &'a ModelFiles, t: &'a TensorEntry) -> Result<Stored<'a>> {
        let Encoding::Ggml(ty) = t.encoding else {
            bail!("{}: stored as {}, not GGML blocks", t.name, t.encoding);
        };
        let (outer, rows, row_len) = match t.shape[..] {
            [r, c] => (1, r, c),
            [e, r, c] => (e, r, c),
            _ => bail!(
                "{}: shape {:?} is not a matrix or a stack of them",
                t.name,
                t.shape
            ),
        };
        let row_bytes = ty
            .bytes_for(row_len)
            .ok_or_else(|| anyhow!("{}: rows of {row_len} are not whole {} blocks", t.name, ty))?;
        Ok(Stored {
            name: &t.name,
            data: files.bytes(t),
            ty,
            outer,
            rows,
            row_len,
            row_bytes,
        })
    }

    fn whole(&self) -> Region {
        Region {
            rows: 0..self.rows,
            cols: 0..self.row_bytes,
        }
    }

    fn shape(&self, r: &Region) -> Vec<u64> {
        let inner = [r.rows.end - r.rows.start, r.cols.end - r.cols.start];
        if self.outer == 1 {
            inner.to_vec()
        } else {
            [&[self.outer][..], &inner].concat()
        }
    }

    /// FNV-1a 64 over the region's bytes, row-major; `None` when it lies outside the tensor.
    fn hash(&self, r: &Region) -> Option<u64> {
        if r.rows.end > self.rows || r.cols.end > self.row_bytes || r.rows.start > r.rows.end {
            return None;
        }
        let rows = (0..self.outer).flat_map(|o| r.rows.clone().map(move |row| (o, row)));
        let pieces = rows.map(|(o, row)| {
            let at = ((o * self.rows + row) * self.row_bytes) as usize;
            &self.data[at + r.cols.start as usize..at + r.cols.end as usize]
        });
        Some(fnv1a_pieces(pieces))
    }

    fn block(&self) -> (u64, u64) {
        (self.ty.block_size() as u64, self.ty.type_size() as u64)
    }

    fn describe(&self, r: &Region) -> String {
        if *r == self.whole() {
            return "all".into();
        }
        let rows =
            (r.rows != (0..self.rows)).then(|| format!("rows {}..{}", r.rows.start, r.rows.end));
        let cols = (r.cols != (0..self.row_bytes)).then(|| {
            format!(
                "bytes {}..{} of each {}-byte row",
                r.cols.start, r.cols.end, self.row_bytes
            )
        });
        [rows, cols]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Where `cols` starts or ends inside a block: (byte column, block, offset in the block).
    fn cut(&self, cols: &Range<u64>) -> Option<(u64, u64, u64)> {
        let (_, ts) = self.block();
        [cols.start, cols.end]
            .into_iter()
            .find(|b| b % ts != 0)
            .map(|b| (b, b / ts, b % ts))
    }
}

/// The plan's region of the tensor for `rank`: `Err` with the element columns when the plan's
/// column split does not fall on block boundaries.
fn planned(
    s: &Stored,
    p: Placement,
    dims: usize,
    rank: u64,
    tp: u64,
) -> Result<Result<Region, Range<u64>>> {
    let whole = s.whole();
    Ok(match p {
        Placement::Replicated => Ok(whole),
        Placement::Split { axis, parts: 1 } if axis + 2 == dims => {
            let n = s.rows / tp;
            Ok(Region {
                rows: rank * n..(rank + 1) * n,
                cols: whole.cols,
            })
        }
        Placement::Split { axis, parts: 1 } if axis + 1 == dims => {
            let n = s.row_len / tp;
            let (bs, ts) = s.block();
            let elems = rank * n..(rank + 1) * n;
            if elems.start % bs != 0 || !n.is_multiple_of(bs) {
                Err(elems)
            } else {
                Ok(Region {
                    rows: whole.rows,
                    cols: elems.start / bs * ts..elems.end / bs * ts,
                })
            }
        }
        p => bail!("{}: {} has no byte-level check", s.name, p.describe()),
    })
}

/// Judge every listed rank's bytes of GGUF tensor `t` (weight `id`) at TP `tp`.
pub fn identify(
    files: &ModelFiles,
    t: &TensorEntry,
    id: WeightId,
    label: &str,
    tp: u64,
    ep: bool,
    shards: &[QuantShard],
) -> Result<Vec<ByteVerdict>> {
    let s = Stored::new(files, t)?;
    let p = placement(&id, ep);
    if p == Placement::Experts {
        bail!("{label}: quantized shards under expert parallelism have no byte-level check");
    }
    let dims = t.shape.len();
    let plans = (0..tp)
        .map(|r| planned(&s, p, dims, r, tp))
        .collect::<Result<Vec<_>>>()?;
    let mut verdicts: Vec<ByteVerdict> =
        shards.iter().map(|q| judge(&s, label, &plans, q)).collect();
    same_block_everywhere(&s, label, &plans, shards, &mut verdicts);
    for (v, q) in verdicts.iter_mut().zip(shards) {
        let Some(d) = q.dequant else { continue };
        let region = find(&s, &plans, q).map(|(r, _)| r);
        let who = format!("{label} on rank {}", q.rank);
        match engine_dequant(&s, region.as_ref(), d, &who)? {
            Ok(check) => v.dequant = Some(check),
            Err(evidence) if v.class.is_none() => {
                v.class = Some(FaultClass::WrongDequant);
                v.evidence = evidence;
            }
            Err(evidence) => v.evidence = format!("{}; {evidence}", v.evidence),
        }
    }
    Ok(verdicts)
}

/// The engine's dequantization of the bytes of `region` against ggml's, rounded to the
/// engine's dtype: `Err` with the evidence of a mismatch (the first differing block, its sums).
fn engine_dequant(
    s: &Stored,
    region: Option<&Region>,
    d: &EngineDequant,
    who: &str,
) -> Result<std::result::Result<DequantCheck, String>> {
    let not_run = |why: String| {
        Ok(Ok(DequantCheck::NotRun {
            op: d.op.clone(),
            why,
        }))
    };
    if let Some(why) = &d.absent {
        return not_run(why.clone());
    }
    let (Some(dtype), Some(hash)) = (d.dtype, d.hash) else {
        return not_run("the manifest gives no output".into());
    };
    let (bs, ts) = s.block();
    let Some(r) = region.filter(|r| r.cols.start % ts == 0 && r.cols.end % ts == 0) else {
        return not_run("the bytes are no whole blocks of the file tensor".into());
    };
    let mut values = Vec::new();
    for o in 0..s.outer {
        for row in r.rows.clone() {
            let at = ((o * s.rows + row) * s.row_bytes) as usize;
            let bytes = &s.data[at + r.cols.start as usize..at + r.cols.end as usize];
            let start = values.len();
            values.resize(start + bytes.len() / ts as usize * bs as usize, 0f32);
            quant::dequantize(s.ty, bytes, &mut values[start..])
                .map_err(|e| anyhow!("{who}: {e}"))?;
        }
    }
    if dtype.hash(&values) == hash.0 {
        return Ok(Ok(DequantCheck::Equal { op: d.op.clone() }));
    }
    let ours: Vec<f64> = values
        .chunks(bs as usize)
        .map(|b| b.iter().map(|&x| f64::from(dtype.round(x))).sum())
        .collect();
    let first = ours
        .iter()
        .zip(&d.block_sums)
        .position(|(a, b)| (a - b).abs() > 1e-6 * (a.abs() + b.abs()) + 1e-12);
    let per_row = ((r.cols.end - r.cols.start) / ts).max(1) as usize;
    let at = match first {
        Some(i) => format!(
            "first at block {i} (row {} of the shard, elements {}..{}): block sum {:.6e} from \
             the engine, {:.6e} from ggml",
            i / per_row,
            i % per_row * bs as usize,
            (i % per_row + 1) * bs as usize,
            d.block_sums[i],
            ours[i]
        ),
        None if d.block_sums.len() != ours.len() => format!(
            "{} block sums from the engine for {} blocks",
            d.block_sums.len(),
            ours.len()
        ),
        None => "every block's sum agrees: the values differ in their last bits".into(),
    };
    Ok(Err(format!(
        "{who}: the engine's {} reads these {} bytes differently from ggml ({} values in {}, \
         output hash {:016x}, ggml's {:016x}): {at}",
        d.op,
        s.ty.name(),
        values.len(),
        dtype.name(),
        hash.0,
        dtype.hash(&values)
    )))
}

/// What `q` holds: the first region with its shape and hash, and its name.
fn find(
    s: &Stored,
    plans: &[Result<Region, Range<u64>>],
    q: &QuantShard,
) -> Option<(Region, String)> {
    let mut candidates: Vec<(Region, String)> = plans
        .iter()
        .enumerate()
        .filter_map(|(r, p)| {
            p.as_ref()
                .ok()
                .map(|p| (p.clone(), format!("rank {r}'s block")))
        })
        .collect();
    candidates.push((s.whole(), "the whole tensor".into()));
    if let Some(src) = &q.source {
        candidates.push((src.clone(), "the range it names".into()));
    }
    candidates
        .into_iter()
        .find(|(reg, _)| s.shape(reg) == q.shape && s.hash(reg) == Some(q.hash))
}

fn judge(
    s: &Stored,
    label: &str,
    plans: &[Result<Region, Range<u64>>],
    q: &QuantShard,
) -> ByteVerdict {
    let who = format!("{label} on rank {}", q.rank);
    let plan = &plans[q.rank as usize];
    let expected = match plan {
        Ok(r) => s.describe(r),
        Err(e) => format!("cols {}..{} (not whole blocks)", e.start, e.end),
    };
    let verdict = |found: Option<String>, class, evidence| ByteVerdict {
        rank: q.rank,
        expected: expected.clone(),
        found,
        class,
        evidence,
        dequant: None,
    };
    if !q.ggml_type.eq_ignore_ascii_case(s.ty.name()) {
        return verdict(
            None,
            Some(FaultClass::Unknown),
            format!(
                "{who} holds {} blocks; the file stores {} as {}",
                q.ggml_type,
                s.name,
                s.ty.name()
            ),
        );
    }
    let found = find(s, plans, q);
    let held = found.as_ref().map(|(r, _)| s.describe(r));
    if let Err(elems) = plan {
        let (bs, ts) = s.block();
        let bytes = found
            .as_ref()
            .map(|(r, _)| r.cols.clone())
            .or(q.source.as_ref().map(|r| r.cols.clone()));
        let at = bytes.as_ref().and_then(|c| s.cut(c)).map_or(String::new(), |(b, blk, off)| {
            format!("; it holds bytes {}..{} of each row, cut at byte {b}: byte {off} of block {blk}",
                    bytes.as_ref().map_or(0, |c| c.start), bytes.as_ref().map_or(0, |c| c.end))
        });
        return verdict(
            held,
            Some(FaultClass::WrongShardLayout),
            format!(
                "{who}: the plan's columns {}..{} of {} cut {} blocks ({bs} elements, {ts} bytes): \
                 column {} is element {} of block {}{at}",
                elems.start, elems.end, s.row_len, s.ty.name(),
                if elems.start % bs != 0 { elems.start } else { elems.end },
                if elems.start % bs != 0 { elems.start % bs } else { elems.end % bs },
                if elems.start % bs != 0 { elems.start / bs } else { elems.end / bs },
            ),
        );
    }
    let plan = plan.as_ref().expect("checked above");
    let plan_text = format!("the plan gives {}", s.describe(plan));
    match found {
        Some((r, _)) if r == *plan => verdict(
            held,
            None,
            format!("{who} holds {}, as planned", s.describe(&r)),
        ),
        Some((r, what)) if r == s.whole() => verdict(
            held,
            Some(FaultClass::UnshardedWeight),
            format!("{who} holds {what} ({}); {plan_text}", s.describe(&r)),
        ),
        Some((r, what)) => {
            let cut = s.cut(&r.cols).map_or(String::new(), |(b, blk, off)| {
                format!(", cut at byte {b}: byte {off} of block {blk}")
            });
            verdict(
                held,
                Some(FaultClass::WrongShardLayout),
                format!("{who} holds {what} ({}{cut}); {plan_text}", s.describe(&r)),
            )
        }
        None => verdict(
            None,
            Some(FaultClass::Unknown),
            format!(
                "{who}: its bytes match no slice of {} ({:?} bytes); {plan_text}",
                s.name, q.shape
            ),
        ),
    }
}

/// Every rank holding rank 0's block: an unsharded weight, not ranks in the wrong order.
fn same_block_everywhere(
    s: &Stored,
    label: &str,
    plans: &[Result<Region, Range<u64>>],
    shards: &[QuantShard],
    verdicts: &mut [ByteVerdict],
) {
    let tp = plans.len() as u64;
    let Some(Ok(first)) = plans.first() else {
        return;
    };
    let all = (0..tp).all(|r| shards.iter().any(|q| q.rank == r))
        && shards
            .iter()
            .all(|q| find(s, plans, q).is_some_and(|(r, _)| r == *first));
    if tp < 2 || !all || *first == s.whole() {
        return;
    }
    for v in verdicts.iter_mut().filter(|v| v.class.is_some()) {
        v.class = Some(FaultClass::UnshardedWeight);
        v.evidence = format!(
            "{label} on rank {} holds {}, the same block as every rank; the plan gives {}",
            v.rank,
            s.describe(first),
            v.expected
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(data: &[u8], rows: u64, row_len: u64) -> Stored<'_> {
        let ty = GgmlType::from_name("Q8_0").unwrap(); // 32 elements in 34 bytes
        Stored {
            name: "blk.0.attn_output.weight",
            data,
            ty,
            outer: 1,
            rows,
            row_len,
            row_bytes: ty.bytes_for(row_len).unwrap(),
        }
    }

    #[test]
    fn a_column_split_inside_a_block_names_the_block_and_byte() {
        let data: Vec<u8> = (0..2 * 68).map(|b| b as u8).collect();
        let s = stored(&data, 2, 64);
        let split = Placement::Split { axis: 1, parts: 1 };
        // 64 columns over 2 ranks: whole blocks; over 4: 16 columns, half a block.
        assert_eq!(
            planned(&s, split, 2, 1, 2).unwrap(),
            Ok(Region {
                rows: 0..2,
                cols: 34..68
            })
        );
        assert_eq!(planned(&s, split, 2, 1, 4).unwrap(), Err(16..32));
        let src = Region {
            rows: 0..2,
            cols: 17..34,
        };
        let h = s.hash(&src).unwrap();
        let plans: Vec<_> = (0..4)
            .map(|r| planned(&s, split, 2, r, 4).unwrap())
            .collect();
        let q = QuantShard {
            rank: 1,
            ggml_type: "Q8_0",
            shape: &[2, 17],
            hash: h,
            source: Some(src),
            dequant: None,
        };
        let v = judge(&s, "o_proj", &plans, &q);
        assert_eq!(v.class, Some(FaultClass::WrongShardLayout));
        assert!(
            v.evidence.contains("column 16 is element 16 of block 0"),
            "{}",
            v.evidence
        );
        assert!(
            v.evidence.contains("cut at byte 17: byte 17 of block 0"),
            "{}",
            v.evidence
        );
    }

    #[test]
    fn bytes_are_found_as_the_planned_block_another_ranks_or_the_whole() {
        let data: Vec<u8> = (0..4 * 34).map(|b| (b * 7) as u8).collect();
        let s = stored(&data, 4, 32);
        let rows = Placement::Split { axis: 0, parts: 1 };
        let plans: Vec<_> = (0..2)
            .map(|r| planned(&s, rows, 2, r, 2).unwrap())
            .collect();
        let shard = |rank, reg: &Region| (rank, s.shape(reg), s.hash(reg).unwrap());
        let cases = [
            (shard(1, plans[1].as_ref().unwrap()), None),
            (
                shard(1, plans[0].as_ref().unwrap()),
                Some(FaultClass::WrongShardLayout),
            ),
            (shard(1, &s.whole()), Some(FaultClass::UnshardedWeight)),
            ((1, vec![2, 34], 5), Some(FaultClass::Unknown)),
        ];
        for ((rank, shape, hash), class) in cases {
            let q = QuantShard {
                rank,
                ggml_type: "Q8_0",
                shape: &shape,
                hash,
                source: None,
                dequant: None,
            };
            assert_eq!(judge(&s, "q_b", &plans, &q).class, class);
        }
    }
}
