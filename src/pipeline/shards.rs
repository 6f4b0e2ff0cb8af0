//! `glmcheck shards`: vLLM's tensor-parallel plan applied to a checkpoint ([`plan`]), and an
//! engine's shard manifest checked against it ([`actual`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use globset::Glob;

use super::model::glm5_config;
use crate::compare::Status;
use crate::diagnose::manifest::{check, CheckedShard, ManifestCheck};
use crate::exec::source::WeightSource;
use crate::model::names::WeightId;
use crate::model::schema::{self, Family};
use crate::model::Glm5Config;
use crate::report::shards::{
    ActualReport, DequantTally, Mismatch, NotInManifest, PlanReport, PlannedWeight, RankShare,
    ShardRow,
};
use crate::shard::bytes::DequantCheck;
use crate::shard::manifest::ShardManifest;
use crate::shard::plan::{check_degree, expert_rank, placement, rank_view, Placement};
use crate::weights::ModelFiles;

/// What `shards` looks at.
#[derive(Clone, Debug)]
pub struct ShardsOptions {
    /// A GLM-5 checkpoint.
    pub model: PathBuf,
    /// Tensor-parallel degree; default 1, or against a manifest the manifest's (given, it must
    /// agree with the manifest).
    pub tp: Option<u64>,
    /// Expert parallelism: routed experts whole per rank; against a manifest, the manifest must
    /// say so too.
    pub ep: bool,
    /// Only the tensors matching this glob in the report's table; default: every tensor of the
    /// first dense and the first MoE layer, and those outside layers (the others repeat them).
    pub tensor: Option<String>,
}

/// The checkpoint and its GLM-5 config.
fn open(o: &ShardsOptions) -> Result<(ModelFiles, Glm5Config, Family)> {
    if o.tp == Some(0) {
        bail!("--tp 0: the degree is at least 1");
    }
    let files = ModelFiles::open(&o.model)?;
    let Some((cfg, family)) = glm5_config(&files)? else {
        bail!("{}: not a GLM-5 checkpoint", o.model.display());
    };
    Ok((files, cfg, family))
}

/// Which weights the tables list: `--tensor`'s glob, else the first dense and first MoE layer
/// and the weights outside layers.
fn shown_filter(
    tensor: Option<&str>,
    cfg: &Glm5Config,
) -> Result<impl Fn(&str, &WeightId) -> bool> {
    let glob = tensor
        .map(Glob::new)
        .transpose()?
        .map(|g| g.compile_matcher());
    let first_moe = cfg.first_k_dense_replace;
    Ok(move |name: &str, id: &WeightId| match &glob {
        Some(g) => g.is_match(name),
        None => id.layer().is_none_or(|l| l == 0 || l == first_moe),
    })
}

/// One tensor's placement and what each rank of `tp` holds of it.
fn planned(
    name: &str,
    shape: &[u64],
    nbytes: u64,
    id: &WeightId,
    (tp, ep): (u64, bool),
    experts: u64,
) -> Result<PlannedWeight> {
    let p = placement(id, ep);
    let total: u64 = shape.iter().product::<u64>().max(1);
    let ranks = (0..tp)
        .map(|r| -> Result<RankShare> {
            if let (Placement::Experts, WeightId::Expert { expert, .. }) = (p, id) {
                let owner = expert_rank(*expert, experts, tp);
                let (holds, bytes) = if owner == r {
                    ("all", nbytes)
                } else {
                    ("none", 0)
                };
                return Ok(RankShare {
                    bytes,
                    holds: holds.into(),
                });
            }
            let view = rank_view(p, shape, r, tp).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
            Ok(RankShare {
                bytes: nbytes * view.elements(shape) / total,
                holds: view.describe(p, shape.len()),
            })
        })
        .collect::<Result<_>>()?;
    Ok(PlannedWeight {
        name: name.to_string(),
        placement: p.describe(),
        ranks,
        shape: shape.to_vec(),
    })
}

/// vLLM's plan at `o.tp` (default 1): per shown weight its placement and what each rank holds,
/// and the bytes of every rank.
pub fn plan(o: &ShardsOptions) -> Result<PlanReport> {
    let (files, cfg, family) = open(o)?;
    let tp = o.tp.unwrap_or(1);
    check_degree(&cfg, tp)?;
    let shown = shown_filter(o.tensor.as_deref(), &cfg)?;
    let (mut weights, mut per_rank) = (Vec::new(), vec![0u64; tp as usize]);
    for t in files.tensors() {
        let Some(id) = schema::role(family, &t.name) else {
            per_rank.iter_mut().for_each(|b| *b += t.nbytes);
            continue;
        };
        let w = planned(
            &t.name,
            &t.shape,
            t.nbytes,
            &id,
            (tp, o.ep),
            cfg.n_routed_experts,
        )?;
        per_rank
            .iter_mut()
            .zip(&w.ranks)
            .for_each(|(b, r)| *b += r.bytes);
        if shown(&t.name, &id) {
            weights.push(w);
        }
    }
    Ok(PlanReport {
        bytes_per_rank: per_rank,
        ep: o.ep,
        format: family,
        tp,
        weights,
    })
}

/// The shards of the manifest at `path` against the plan at the manifest's degree. Errors: a
/// degree or expert parallelism in `o` the manifest does not share, and those of [`check`].
pub fn actual(o: &ShardsOptions, path: &Path) -> Result<ActualReport> {
    let (files, cfg, family) = open(o)?;
    let ws = WeightSource::new(files, cfg, family);
    let m = ShardManifest::read(path)?;
    let at = path.display();
    if let Some(tp) = o.tp.filter(|&tp| tp != m.tp) {
        bail!("--tp {tp}: {at} holds the shards of tp {}", m.tp);
    }
    if o.ep && !m.ep {
        bail!("--ep: {at} holds shards without expert parallelism (ep false)");
    }
    let c = check(&ws, &m).with_context(|| at.to_string())?;
    let shown = shown_filter(o.tensor.as_deref(), &ws.cfg)?;
    Ok(actual_report(&m, &c, shown))
}

/// The report of check `c` of manifest `m`: the mismatches, and the table's rows of the weights
/// `shown` picks.
fn actual_report(
    m: &ShardManifest,
    c: &ManifestCheck,
    shown: impl Fn(&str, &WeightId) -> bool,
) -> ActualReport {
    let (mut mismatches, mut rows) = (Vec::new(), Vec::new());
    for group in c.shards.chunk_by(|a, b| a.weight == b.weight) {
        for s in group {
            if let Some(class) = s.class {
                rows.push(ShardRow::Mismatch(mismatches.len()));
                mismatches.push(Mismatch {
                    class,
                    evidence: s.evidence.clone(),
                    expected: s.expected.clone(),
                    found: s.found.clone(),
                    rank: s.rank,
                    weight: s.weight.clone(),
                });
            }
        }
        let ok: Vec<&CheckedShard> = group.iter().filter(|s| s.class.is_none()).collect();
        if let (Some(first), Some(last)) = (ok.first(), ok.last()) {
            if shown(&first.weight, &first.id) {
                rows.push(ShardRow::Planned {
                    weight: first.weight.clone(),
                    ranks: ok.iter().map(|s| s.rank).collect(),
                    first: first.expected.clone(),
                    last: last.expected.clone(),
                });
            }
        }
    }
    let mut not_in_manifest = Vec::new();
    for (name, id, ranks) in &c.not_in_manifest {
        if shown(name, id) {
            rows.push(ShardRow::NotInManifest(not_in_manifest.len()));
        }
        not_in_manifest.push(NotInManifest {
            ranks: ranks.clone(),
            weight: name.clone(),
        });
    }
    let pass = mismatches.is_empty() && !c.shards.is_empty();
    ActualReport {
        checked: c.shards.len(),
        engine_dequant: dequant_tally(&c.shards),
        ep: m.ep,
        ok: c.shards.len() - mismatches.len(),
        mismatches,
        not_in_manifest,
        tp: m.tp,
        verdict: if pass { Status::Pass } else { Status::Fail },
        rows,
    }
}

/// How many shards' engine dequantization equals ggml's, and why the others were not checked
/// (each reason with its count).
fn dequant_tally(shards: &[CheckedShard]) -> DequantTally {
    let mut tally = DequantTally::default();
    for d in shards.iter().filter_map(|s| s.dequant.as_ref()) {
        match d {
            DequantCheck::Equal { .. } => tally.equal += 1,
            DequantCheck::NotRun { op, why } => {
                let why = format!("{op}: {why}");
                match tally.not_run.iter_mut().find(|(w, _)| *w == why) {
                    Some((_, n)) => *n += 1,
                    None => tally.not_run.push((why, 1)),
                }
            }
        }
    }
    tally
}
