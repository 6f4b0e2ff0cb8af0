//! `glmcheck shards MODEL --tp N [--ep]`: vLLM's tensor-parallel plan applied to a checkpoint —
//! per weight, how it is placed and what each rank holds, and the bytes per rank; with
//! `--actual MANIFEST`, what an engine says each rank holds checked against that plan.

use std::path::PathBuf;

use super::{ModelArg, Outcome};
use crate::pipeline::shards::{actual, plan, ShardsOptions};
use crate::report::shards::{actual_text, plan_text};

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

pub fn run(args: ShardsArgs) -> anyhow::Result<Outcome> {
    let options = ShardsOptions {
        model: args.model.model,
        tp: args.tp,
        ep: args.ep,
        tensor: args.tensor,
    };
    let json = args.model.json;
    let Some(manifest) = args.actual else {
        let report = plan(&options)?;
        if json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{}", plan_text(&report));
        }
        return Ok(Outcome::Pass);
    };
    let report = actual(&options, &manifest)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", actual_text(&report));
    }
    Ok(Outcome::from(report.verdict))
}
