//! `glmcheck shards MODEL --tp N [--ep]`: vLLM's tensor-parallel plan applied to a checkpoint —
//! per weight, how it is placed and what each rank holds, and the bytes per rank; with
//! `--actual MANIFEST`, what an engine says each rank holds checked against that plan.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use globset::Glob;
use serde_json::json;

use super::output::{bytes, shape, table};
use super::{ModelArg, Outcome};
use crate::diagnose::manifest::{check, CheckedShard};
use crate::exec::source::WeightSource;
use crate::model::names::WeightId;
use crate::model::schema::{self, Family};
use crate::model::Glm5Config;
use crate::pipeline::model::glm5_config;
use crate::shard::bytes::DequantCheck;
use crate::shard::manifest::ShardManifest;
use crate::shard::plan::{check_degree, expert_rank, placement, rank_view, Placement};
use crate::weights::ModelFiles;

#[derive(clap::Args, Debug)]
pub struct ShardsArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Tensor-parallel degree (GLM-5's 64 heads allow 1, 2, 4, 8, 16, 32, 64); default 1, or
    /// with `--actual` the manifest's (given, it must agree with the manifest).
    #[arg(long)]
    pub tp: Option<u64>,
    /// Expert parallelism: routed experts whole per rank instead of split along their
    /// intermediate dimension. With `--actual` the manifest's `ep` decides; given, the manifest
    /// must say so too.
    #[arg(long)]
    pub ep: bool,
    /// Only tensors matching this glob; default: every tensor of the first dense and the first
    /// MoE layer, and those outside layers (the others repeat them). With `--actual` it picks
    /// the weights whose correct shards are listed; mismatches are listed wherever they are.
    #[arg(long, value_name = "GLOB")]
    pub tensor: Option<String>,
    /// An engine's shard manifest (JSON, format `glmcheck-shards`, see README "Shard
    /// manifests"): each listed shard is identified by its values' hash or statistics as the
    /// plan's slice for its rank, or as `unsharded_weight` (the whole tensor, or the same block
    /// on every rank), `wrong_shard_layout` (another rank's block, a split along the wrong axis,
    /// merged gate/up taken as one block) or unidentified (`unknown`). Exit 1 on any mismatch or
    /// when the manifest lists no shard; weights of the plan the manifest leaves out are
    /// reported as "not in manifest" and do not fail the check.
    #[arg(long, value_name = "MANIFEST")]
    pub actual: Option<PathBuf>,
}

/// One tensor's placement and per-rank share.
struct Row {
    name: String,
    shape: Vec<u64>,
    placement: Placement,
    /// Per rank: what it holds (`rows 0..3584`), and its bytes.
    ranks: Vec<(String, u64)>,
}

fn row(
    name: &str,
    shape_: &[u64],
    nbytes: u64,
    id: &WeightId,
    (tp, ep): (u64, bool),
    experts: u64,
) -> anyhow::Result<Row> {
    let p = placement(id, ep);
    let total: u64 = shape_.iter().product::<u64>().max(1);
    let ranks = (0..tp)
        .map(|r| -> anyhow::Result<(String, u64)> {
            if let (Placement::Experts, WeightId::Expert { expert, .. }) = (p, id) {
                let owner = expert_rank(*expert, experts, tp);
                return Ok(if owner == r {
                    ("all".into(), nbytes)
                } else {
                    ("none".into(), 0)
                });
            }
            let view = rank_view(p, shape_, r, tp).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
            Ok((
                view.describe(p, shape_.len()),
                nbytes * view.elements(shape_) / total,
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(Row {
        name: name.to_string(),
        shape: shape_.to_vec(),
        placement: p,
        ranks,
    })
}

/// Which weights the tables list: `--tensor`'s glob, else the first dense and first MoE layer
/// and the weights outside layers.
fn shown_filter(
    args: &ShardsArgs,
    cfg: &Glm5Config,
) -> anyhow::Result<impl Fn(&str, &WeightId) -> bool> {
    let glob = args
        .tensor
        .as_deref()
        .map(Glob::new)
        .transpose()?
        .map(|g| g.compile_matcher());
    let first_moe = cfg.first_k_dense_replace;
    Ok(move |name: &str, id: &WeightId| match &glob {
        Some(g) => g.is_match(name),
        None => id.layer().is_none_or(|l| l == 0 || l == first_moe),
    })
}

pub fn run(args: ShardsArgs) -> anyhow::Result<Outcome> {
    if args.tp == Some(0) {
        bail!("--tp 0: the degree is at least 1");
    }
    let files = ModelFiles::open(&args.model.model)?;
    let Some((cfg, family)) = glm5_config(&files)? else {
        bail!("{}: not a GLM-5 checkpoint", args.model.model.display());
    };
    match args.actual.clone() {
        Some(manifest) => actual(&args, &manifest, WeightSource::new(files, cfg, family)),
        None => plan(&args, &files, &cfg, family),
    }
}

fn plan(
    args: &ShardsArgs,
    files: &ModelFiles,
    cfg: &Glm5Config,
    family: Family,
) -> anyhow::Result<Outcome> {
    let tp = args.tp.unwrap_or(1);
    check_degree(cfg, tp)?;
    let shown = shown_filter(args, cfg)?;
    let (mut rows, mut per_rank) = (Vec::new(), vec![0u64; tp as usize]);
    for t in files.tensors() {
        let Some(id) = schema::role(family, &t.name) else {
            per_rank.iter_mut().for_each(|b| *b += t.nbytes);
            continue;
        };
        let r = row(
            &t.name,
            &t.shape,
            t.nbytes,
            &id,
            (tp, args.ep),
            cfg.n_routed_experts,
        )?;
        per_rank
            .iter_mut()
            .zip(&r.ranks)
            .for_each(|(b, (_, n))| *b += n);
        if shown(&t.name, &id) {
            rows.push(r);
        }
    }
    if args.model.json {
        let weights: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({"name": r.name, "shape": r.shape, "placement": r.placement.describe(),
                       "ranks": r.ranks.iter().map(|(v, b)| json!({"holds": v, "bytes": b})).collect::<Vec<_>>()})
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"tp": tp, "ep": args.ep,
                "format": if family == Family::Gguf { "gguf" } else { "hf" },
                "bytes_per_rank": per_rank, "weights": weights}))?
        );
        return Ok(Outcome::Pass);
    }
    let last = tp as usize - 1;
    let mut t = table(&[
        "tensor",
        "shape",
        "placement",
        "rank 0",
        &format!("rank {last}"),
        "bytes / rank",
    ]);
    for r in &rows {
        t.add_row(vec![
            r.name.clone(),
            shape(&r.shape),
            r.placement.describe().to_string(),
            r.ranks[0].0.clone(),
            r.ranks[last].0.clone(),
            bytes(r.ranks[0].1),
        ]);
    }
    println!("{t}");
    let sizes: Vec<String> = per_rank.iter().map(|&b| bytes(b)).collect();
    println!(
        "TP {tp}{}: bytes per rank {}",
        if args.ep { " with EP" } else { "" },
        sizes.join(", ")
    );
    Ok(Outcome::Pass)
}

/// `all` for every rank of `tp`, else the ranks listed.
fn ranks_text(ranks: &[u64], tp: u64) -> String {
    if ranks.len() as u64 == tp {
        return "all".into();
    }
    let r: Vec<String> = ranks.iter().map(u64::to_string).collect();
    r.join(", ")
}

/// `--actual`: the manifest's shards against the plan at the manifest's degree.
fn actual(args: &ShardsArgs, path: &Path, ws: WeightSource) -> anyhow::Result<Outcome> {
    let m = ShardManifest::read(path)?;
    let at = path.display();
    if let Some(tp) = args.tp.filter(|&tp| tp != m.tp) {
        bail!("--tp {tp}: {at} holds the shards of tp {}", m.tp);
    }
    if args.ep && !m.ep {
        bail!("--ep: {at} holds shards without expert parallelism (ep false)");
    }
    let c = check(&ws, &m).with_context(|| at.to_string())?;
    let bad: Vec<&CheckedShard> = c.shards.iter().filter(|s| s.class.is_some()).collect();
    let pass = bad.is_empty() && !c.shards.is_empty();
    let outcome = if pass { Outcome::Pass } else { Outcome::Fail };
    if args.model.json {
        let mismatches: Vec<_> = bad
            .iter()
            .map(|s| {
                json!({"weight": s.weight, "rank": s.rank, "expected": s.expected,
                       "found": s.found, "class": s.class.map(|c| c.name()),
                       "evidence": s.evidence})
            })
            .collect();
        let missing: Vec<_> = c
            .not_in_manifest
            .iter()
            .map(|(name, _, ranks)| json!({"weight": name, "ranks": ranks}))
            .collect();
        let (equal, not_run) = dequant_checks(&c.shards);
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "verdict": if pass { "pass" } else { "fail" }, "tp": m.tp, "ep": m.ep,
                "checked": c.shards.len(), "ok": c.shards.len() - bad.len(),
                "mismatches": mismatches, "not_in_manifest": missing,
                "engine_dequant": {"equal": equal, "not_run": not_run}}))?
        );
        return Ok(outcome);
    }
    let shown = shown_filter(args, &ws.cfg)?;
    let mut t = table(&["weight", "rank", "expected", "found", "verdict"]);
    for group in c.shards.chunk_by(|a, b| a.weight == b.weight) {
        for s in group.iter().filter(|s| s.class.is_some()) {
            let verdict = s.class.map_or("", |c| c.name());
            t.add_row(vec![
                s.weight.clone(),
                s.rank.to_string(),
                s.expected.clone(),
                s.found.clone().unwrap_or_else(|| "unidentified".into()),
                verdict.into(),
            ]);
        }
        let ok: Vec<&CheckedShard> = group.iter().filter(|s| s.class.is_none()).collect();
        if let (Some(first), Some(last)) = (ok.first(), ok.last()) {
            if shown(&first.weight, &first.id) {
                let ranks: Vec<u64> = ok.iter().map(|s| s.rank).collect();
                let expected = match ok.len() {
                    1 => first.expected.clone(),
                    _ => format!("{} … {}", first.expected, last.expected),
                };
                let row = [
                    &first.weight,
                    &ranks_text(&ranks, m.tp),
                    &expected,
                    "as planned",
                    "ok",
                ];
                t.add_row(row.map(str::to_string).to_vec());
            }
        }
    }
    for (name, id, ranks) in &c.not_in_manifest {
        if shown(name, id) {
            let row = [name, &ranks_text(ranks, m.tp), "", "", "not in manifest"];
            t.add_row(row.map(str::to_string).to_vec());
        }
    }
    println!("{t}");
    for s in &bad {
        println!("  {}", s.evidence);
    }
    let mut classes: Vec<&str> = bad
        .iter()
        .filter_map(|s| s.class.map(|c| c.name()))
        .collect();
    classes.sort_unstable();
    classes.dedup();
    let (equal, not_run) = dequant_checks(&c.shards);
    if equal > 0 {
        println!("engine dequantization: {equal} quantized shards read as ggml reads them");
    }
    for (why, n) in &not_run {
        println!("engine dequantization NOT checked on {n} quantized shards: {why}");
    }
    println!(
        "TP {}{}: {} shards checked, {} as planned, {} mismatched{}; {} weights of the plan not in the manifest{}",
        m.tp,
        if m.ep { " with EP" } else { "" },
        c.shards.len(),
        c.shards.len() - bad.len(),
        bad.len(),
        if classes.is_empty() { String::new() } else { format!(" ({})", classes.join(", ")) },
        c.not_in_manifest.len(),
        if c.shards.is_empty() { " — the manifest lists no shard: nothing checked" } else { "" },
    );
    Ok(outcome)
}

/// How many shards' engine dequantization equals ggml's, and why the others were not checked
/// (each reason with its count).
fn dequant_checks(shards: &[CheckedShard]) -> (usize, Vec<(String, usize)>) {
    let mut equal = 0;
    let mut not_run: Vec<(String, usize)> = Vec::new();
    for d in shards.iter().filter_map(|s| s.dequant.as_ref()) {
        match d {
            DequantCheck::Equal { .. } => equal += 1,
            DequantCheck::NotRun { op, why } => {
                let why = format!("{op}: {why}");
                match not_run.iter_mut().find(|(w, _)| *w == why) {
                    Some((_, n)) => *n += 1,
                    None => not_run.push((why, 1)),
                }
            }
        }
    }
    (equal, not_run)
}
