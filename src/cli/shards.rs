//! `glmcheck shards MODEL --tp N [--ep]`: vLLM's tensor-parallel plan applied to a checkpoint —
//! per weight, how it is placed and what each rank holds, and the bytes per rank.

use globset::Glob;
use serde_json::json;

use super::inspect::glm5_config;
use super::output::{bytes, shape, table};
use super::{ModelArg, Outcome};
use crate::model::names::WeightId;
use crate::model::schema::{self, Family};
use crate::shard::plan::{check_degree, expert_rank, placement, rank_view, Placement};
use crate::weights::ModelFiles;

#[derive(clap::Args, Debug)]
pub struct ShardsArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Tensor-parallel degree (GLM-5's 64 heads allow 1, 2, 4, 8, 16, 32, 64).
    #[arg(long, default_value_t = 1)]
    pub tp: u64,
    /// Expert parallelism: routed experts whole per rank instead of split along their
    /// intermediate dimension.
    #[arg(long)]
    pub ep: bool,
    /// Only tensors matching this glob; default: every tensor of the first dense and the first
    /// MoE layer, and those outside layers (the others repeat them).
    #[arg(long, value_name = "GLOB")]
    pub tensor: Option<String>,
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
    args: &ShardsArgs,
    experts: u64,
) -> anyhow::Result<Row> {
    let p = placement(id, args.ep);
    let total: u64 = shape_.iter().product::<u64>().max(1);
    let ranks = (0..args.tp)
        .map(|r| -> anyhow::Result<(String, u64)> {
            if let (Placement::Experts, WeightId::Expert { expert, .. }) = (p, id) {
                let owner = expert_rank(*expert, experts, args.tp);
                return Ok(if owner == r {
                    ("all".into(), nbytes)
                } else {
                    ("none".into(), 0)
                });
            }
            let view =
                rank_view(p, shape_, r, args.tp).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
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

pub fn run(args: ShardsArgs) -> anyhow::Result<Outcome> {
    if args.tp == 0 {
        anyhow::bail!("--tp 0: the degree is at least 1");
    }
    let files = ModelFiles::open(&args.model.model)?;
    let Some((cfg, family)) = glm5_config(&files)? else {
        anyhow::bail!("{}: not a GLM-5 checkpoint", args.model.model.display());
    };
    check_degree(&cfg, args.tp)?;
    let glob = args
        .tensor
        .as_deref()
        .map(Glob::new)
        .transpose()?
        .map(|g| g.compile_matcher());
    let first_moe = cfg.first_k_dense_replace;
    let shown = |name: &str, id: &WeightId| match &glob {
        Some(g) => g.is_match(name),
        None => id.layer().is_none_or(|l| l == 0 || l == first_moe),
    };
    let (mut rows, mut per_rank) = (Vec::new(), vec![0u64; args.tp as usize]);
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
            &args,
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
            serde_json::to_string_pretty(&json!({"tp": args.tp, "ep": args.ep,
                "format": if family == Family::Gguf { "gguf" } else { "hf" },
                "bytes_per_rank": per_rank, "weights": weights}))?
        );
        return Ok(Outcome::Pass);
    }
    let last = args.tp as usize - 1;
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
        "TP {}{}: bytes per rank {}",
        args.tp,
        if args.ep { " with EP" } else { "" },
        sizes.join(", ")
    );
    Ok(Outcome::Pass)
}
