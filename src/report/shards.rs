//! `glmcheck shards`: vLLM's tensor-parallel plan per weight and rank ([`PlanReport`]), and an
//! engine's shard manifest checked against it ([`ActualReport`]); each as JSON or as a terminal
//! table with a summary.

use std::fmt::Write;

use serde::Serialize;

use super::terminal::{bytes, shape, table};
use crate::compare::{FaultClass, Status};
use crate::model::schema::Family;

/// The plan at one degree: what each shown weight's ranks hold, and the bytes of every rank.
#[derive(Clone, Debug, Serialize)]
pub struct PlanReport {
    /// Per rank, over every tensor of the checkpoint (shown or not; unknown ones replicated).
    pub bytes_per_rank: Vec<u64>,
    pub ep: bool,
    pub format: Family,
    pub tp: u64,
    /// The weights the table shows, in the checkpoint's order.
    pub weights: Vec<PlannedWeight>,
}

/// One weight's placement and what each rank holds of it.
#[derive(Clone, Debug, Serialize)]
pub struct PlannedWeight {
    pub name: String,
    /// How vLLM places it: `replicated`, `split rows (ColumnParallel / vocab-parallel)`, ….
    pub placement: &'static str,
    /// Per rank, in rank order.
    pub ranks: Vec<RankShare>,
    pub shape: Vec<u64>,
}

/// What one rank holds of a weight.
#[derive(Clone, Debug, Serialize)]
pub struct RankShare {
    pub bytes: u64,
    /// `rows 0..3584`, `all`, `none`.
    pub holds: String,
}

/// An engine's shard manifest against the plan at the manifest's degree.
#[derive(Clone, Debug, Serialize)]
pub struct ActualReport {
    /// Shards the manifest lists.
    pub checked: usize,
    pub engine_dequant: DequantTally,
    pub ep: bool,
    /// The shards that are not what the plan gives, in the manifest's weight order.
    pub mismatches: Vec<Mismatch>,
    /// Weights of the plan the manifest lists on none of the ranks that should hold them.
    pub not_in_manifest: Vec<NotInManifest>,
    /// Shards as the plan gives them.
    pub ok: usize,
    pub tp: u64,
    /// A fail on any mismatch, or when the manifest lists no shard.
    pub verdict: Status,
    /// The terminal table's rows: the weights the tables show (`--tensor`), and every mismatch.
    #[serde(skip)]
    pub rows: Vec<ShardRow>,
}

/// One rank's shard that is not what the plan gives.
#[derive(Clone, Debug, Serialize)]
pub struct Mismatch {
    pub class: FaultClass,
    pub evidence: String,
    /// `rows 48..96`, `all`, `none`.
    pub expected: String,
    /// The same for what the rank holds; `None` when it matches no slice.
    pub found: Option<String>,
    pub rank: u64,
    pub weight: String,
}

/// A weight of the plan the manifest leaves out, and the ranks that should hold it.
#[derive(Clone, Debug, Serialize)]
pub struct NotInManifest {
    pub ranks: Vec<u64>,
    pub weight: String,
}

/// The engine's own dequantization of quantized shards, where the manifest gives it: how many
/// equal ggml's, and why the others were not checked (each reason with its count).
#[derive(Clone, Debug, Default, Serialize)]
pub struct DequantTally {
    pub equal: usize,
    pub not_run: Vec<(String, usize)>,
}

/// One row of the `--actual` table.
#[derive(Clone, Debug)]
pub enum ShardRow {
    /// `mismatches[i]`.
    Mismatch(usize),
    /// A weight's shards that are as planned, on `ranks`: what the first and the last of them
    /// hold.
    Planned {
        weight: String,
        ranks: Vec<u64>,
        first: String,
        last: String,
    },
    /// `not_in_manifest[i]`.
    NotInManifest(usize),
}

/// The plan's table (rank 0's and the last rank's share of each shown weight) and the bytes per
/// rank.
pub fn plan_text(r: &PlanReport) -> String {
    let last = r.tp as usize - 1;
    let mut t = table(&[
        "tensor",
        "shape",
        "placement",
        "rank 0",
        &format!("rank {last}"),
        "bytes / rank",
    ]);
    for w in &r.weights {
        t.add_row(vec![
            w.name.clone(),
            shape(&w.shape),
            w.placement.to_string(),
            w.ranks[0].holds.clone(),
            w.ranks[last].holds.clone(),
            bytes(w.ranks[0].bytes),
        ]);
    }
    let sizes: Vec<String> = r.bytes_per_rank.iter().map(|&b| bytes(b)).collect();
    format!(
        "{t}\nTP {}{}: bytes per rank {}\n",
        r.tp,
        if r.ep { " with EP" } else { "" },
        sizes.join(", ")
    )
}

/// `all` for every rank of `tp`, else the ranks listed.
fn ranks_text(ranks: &[u64], tp: u64) -> String {
    if ranks.len() as u64 == tp {
        return "all".into();
    }
    let r: Vec<String> = ranks.iter().map(u64::to_string).collect();
    r.join(", ")
}

/// The manifest's table, each mismatch's evidence, the engine dequantization's tally and a
/// summary line.
pub fn actual_text(r: &ActualReport) -> String {
    let mut t = table(&["weight", "rank", "expected", "found", "verdict"]);
    for row in &r.rows {
        let cells = match row {
            ShardRow::Mismatch(i) => {
                let s = &r.mismatches[*i];
                [
                    s.weight.clone(),
                    s.rank.to_string(),
                    s.expected.clone(),
                    s.found.clone().unwrap_or_else(|| "unidentified".into()),
                    s.class.name().into(),
                ]
            }
            ShardRow::Planned {
                weight,
                ranks,
                first,
                last,
            } => [
                weight.clone(),
                ranks_text(ranks, r.tp),
                match ranks.len() {
                    1 => first.clone(),
                    _ => format!("{first} … {last}"),
                },
                "as planned".into(),
                "ok".into(),
            ],
            ShardRow::NotInManifest(i) => {
                let w = &r.not_in_manifest[*i];
                [
                    w.weight.clone(),
                    ranks_text(&w.ranks, r.tp),
                    String::new(),
                    String::new(),
                    "not in manifest".into(),
                ]
            }
        };
        t.add_row(cells.to_vec());
    }
    let mut out = format!("{t}\n");
    for s in &r.mismatches {
        let _ = writeln!(out, "  {}", s.evidence);
    }
    let mut classes: Vec<&str> = r.mismatches.iter().map(|s| s.class.name()).collect();
    classes.sort_unstable();
    classes.dedup();
    let d = &r.engine_dequant;
    if d.equal > 0 {
        let _ = writeln!(
            out,
            "engine dequantization: {} quantized shards read as ggml reads them",
            d.equal
        );
    }
    for (why, n) in &d.not_run {
        let _ = writeln!(
            out,
            "engine dequantization NOT checked on {n} quantized shards: {why}"
        );
    }
    let _ = writeln!(
        out,
        "TP {}{}: {} shards checked, {} as planned, {} mismatched{}; {} weights of the plan not in the manifest{}",
        r.tp,
        if r.ep { " with EP" } else { "" },
        r.checked,
        r.ok,
        r.mismatches.len(),
        if classes.is_empty() { String::new() } else { format!(" ({})", classes.join(", ")) },
        r.not_in_manifest.len(),
        if r.checked == 0 { " — the manifest lists no shard: nothing checked" } else { "" },
    );
    out
}
