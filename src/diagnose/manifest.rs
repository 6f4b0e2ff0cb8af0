//! An engine's shard manifest checked against vLLM's plan one weight at a time ([`check`],
//! through [`identify`](crate::shard::identify)), and written as a correct engine would
//! ([`plan_manifest`]). The reference's values come from its [`WeightSource`], which is why this
//! sits above the executor rather than in `shard`.

use std::collections::{BTreeSet, HashMap};

use anyhow::{anyhow, bail, Context, Result};

use crate::compare::fault::FaultClass;
use crate::exec::source::WeightSource;
use crate::model::config::Glm5Config;
use crate::model::names::{LayerWeight, LayerWeight::*, WeightId};
use crate::model::schema::Family;
use crate::shard::bytes::{DequantCheck, QuantShard};
use crate::shard::identify::{Basis, Dtype, Reference};
use crate::shard::manifest::*;
use crate::shard::plan::{check_degree, expert_rank, placement, Placement};

/// vLLM's merged parameters (after `model.layers.N.`): the checkpoint weights stacked along an
/// axis, in order (as vLLM's loader merges them).
const MERGED: &[(&str, &[LayerWeight], usize)] = &[
    ("mlp.gate_up_proj.weight", &[Gate, Up], 0),
    (
        "mlp.shared_experts.gate_up_proj.weight",
        &[SharedGate, SharedUp],
        0,
    ),
    ("self_attn.fused_qkv_a_proj.weight", &[QA, KvA], 0),
    (
        "self_attn.indexer.wk_weights_proj.weight",
        &[IndexerK, IndexerProj],
        0,
    ),
    ("mlp.experts.w13_weight", &[ExpertsGate, ExpertsUp], 1),
    ("mlp.experts.w2_weight", &[ExpertsDown], 0),
];

/// The suffix of an FP8 weight's block scales (`W` → `W_scale_inv`).
const SCALE_SUFFIX: &str = "_scale_inv";

/// The names a manifest may use, for the error that rejects another.
const KNOWN: &str = "names are GGUF or Hugging Face checkpoint names, or vLLM's merged \
     `mlp.gate_up_proj`, `mlp.shared_experts.gate_up_proj`, `self_attn.fused_qkv_a_proj`, \
     `self_attn.indexer.wk_weights_proj`, `mlp.experts.w13_weight`, `mlp.experts.w2_weight`";

/// A manifest name resolved: the checkpoint weights it is made of, stacked along `axis`, or
/// their FP8 block scales (`…weight_scale_inv`, one float per 128×128 block), which the plan
/// cuts as it cuts the weights, block for block. `shared`: the stacked experts carry that many
/// shared experts after the routed ones (vLLM's fused shared experts, ROCm AITER's layout).
struct Target {
    parts: Vec<WeightId>,
    axis: usize,
    scale: bool,
    shared: u64,
}

impl Target {
    fn resolve(name: &str) -> Option<Target> {
        let (name, scale) = match name.strip_suffix(SCALE_SUFFIX) {
            Some(weight) => (weight, true),
            None => (name, false),
        };
        if let Some(id) = WeightId::from_gguf(name).or_else(|| WeightId::from_hf(name)) {
            return Some(Target {
                parts: vec![id],
                axis: 0,
                scale,
                shared: 0,
            });
        }
        let tail = name.strip_prefix("model.layers.")?;
        let (layer, rest) = tail.split_once('.')?;
        let layer: u64 = layer
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| layer.parse().ok())??;
        let &(_, parts, axis) = MERGED.iter().find(|m| m.0 == rest)?;
        Some(Target {
            parts: parts.iter().map(|&w| WeightId::Layer(layer, w)).collect(),
            axis,
            scale,
            shared: 0,
        })
    }

    /// The stacked experts' target with the shared experts fused in, when an entry of `shape`
    /// holds routed plus shared experts (vLLM stores its fused shared experts after the routed
    /// ones in `w13_weight` / `w2_weight`).
    fn fused(mut self, cfg: &Glm5Config, shape: &[u64]) -> Target {
        let experts = self.parts.iter().all(|id| {
            matches!(
                id,
                WeightId::Layer(_, ExpertsGate | ExpertsUp | ExpertsDown)
            )
        });
        let (routed, shared) = (cfg.n_routed_experts, cfg.n_shared_experts);
        if experts && shared > 0 && shape.len() == 3 && shape[0] == routed + shared {
            self.shared = shared;
        }
        self
    }

    /// How the plan lays the whole target out: a merged tensor split part by part.
    fn layout(&self, ws: &WeightSource, tp: u64, ep: bool) -> Layout {
        match self.parts[..] {
            [WeightId::Expert { expert, .. }] if ep => {
                Layout::Owner(expert_rank(expert, ws.cfg.n_routed_experts, tp))
            }
            _ => Layout::Placed(match placement(&self.parts[0], ep) {
                Placement::Split { axis, parts: 1 }
                    if self.parts.len() > 1 && axis == self.axis =>
                {
                    Placement::Split {
                        axis,
                        parts: self.parts.len() as u64,
                    }
                }
                p => p,
            }),
        }
    }

    /// The full values and shape, from the reference dequantization (or the block scales).
    fn load(&self, ws: &WeightSource) -> Result<(Vec<f32>, Vec<u64>)> {
        let parts = self
            .parts
            .iter()
            .map(|&id| {
                let routed = load(ws, id, self.scale)?;
                match (self.shared, shared_expert(id)) {
                    (0, _) | (_, None) => Ok(routed),
                    (n, Some((shared, axis))) => {
                        // Each shared expert is one slice of the shared MLP's intermediate.
                        let (values, shape) = load(ws, shared, self.scale)?;
                        let mut experts = vec![routed];
                        for (v, s) in split(&values, &shape, axis, n as usize)? {
                            experts.push((v, [&[1u64][..], &s].concat()));
                        }
                        concat(experts, 0)
                    }
                }
            })
            .collect::<Result<Vec<_>>>()?;
        concat(parts, self.axis)
    }

    /// The checkpoint weights this target stands for, in one form per weight (see [`normal`]).
    fn covers(&self) -> Vec<WeightId> {
        let shared = self
            .parts
            .iter()
            .filter(|_| self.shared > 0)
            .filter_map(|&id| shared_expert(id).map(|(s, _)| s));
        self.parts
            .iter()
            .flat_map(|&id| normal(id))
            .chain(shared)
            .collect()
    }
}

/// How the plan lays a tensor across the ranks.
enum Layout {
    Placed(Placement),
    /// Whole on one rank (a per-expert tensor under EP).
    Owner(u64),
}

/// A weight in one form whatever the checkpoint's: llama.cpp's k_b / v_b as kv_b, the fused
/// gate_up experts as gate and up.
fn normal(id: WeightId) -> Vec<WeightId> {
    match id {
        WeightId::Layer(l, KB | VB) => vec![WeightId::Layer(l, KvB)],
        WeightId::Layer(l, ExpertsGateUp) => {
            vec![
                WeightId::Layer(l, ExpertsGate),
                WeightId::Layer(l, ExpertsUp),
            ]
        }
        id => vec![id],
    }
}

fn family(ws: &WeightSource) -> Family {
    if ws.files.gguf().is_some() {
        Family::Gguf
    } else {
        Family::Hf
    }
}

fn native_name(ws: &WeightSource, id: WeightId) -> String {
    match family(ws) {
        Family::Gguf => id.gguf_name(),
        Family::Hf => id.hf_name(),
    }
}

/// One checkpoint weight whole, in whatever form the file stores it: kv_b assembled from
/// llama.cpp's k_b / v_b, stacked experts from per-expert tensors and back, fused gate_up from
/// gate and up. With `scale`, the weight's FP8 block scales instead, assembled the same way.
fn load(ws: &WeightSource, id: WeightId, scale: bool) -> Result<(Vec<f32>, Vec<u64>)> {
    let name = native_name(ws, id);
    if scale {
        let scale_name = format!("{name}{SCALE_SUFFIX}");
        if let Some(t) = ws.files.get(&scale_name) {
            return Ok((ws.files.dequantize(t)?, t.shape.clone()));
        }
    } else if let Some(t) = ws.files.get(&name) {
        return Ok((ws.vector(id)?, t.shape.clone()));
    }
    let dims = |rows: usize, cols: usize| vec![rows as u64, cols as u64];
    let which = |w| {
        [ExpertsGate, ExpertsUp, ExpertsDown]
            .iter()
            .position(|&x| x == w)
    };
    match id {
        WeightId::Layer(_, KvB) if !scale => {
            let m = ws.matrix(id)?;
            let shape = dims(m.rows, m.cols);
            Ok((m.into_data(), shape))
        }
        WeightId::Expert {
            layer,
            expert,
            which: w,
        } if !scale => {
            let m = ws
                .expert(layer, expert)?
                .into_iter()
                .nth(which(w).unwrap_or(0));
            let m = m.ok_or_else(|| anyhow!("{name}: not an expert matrix"))?;
            let shape = dims(m.rows, m.cols);
            Ok((m.into_data(), shape))
        }
        WeightId::Layer(l, w @ (ExpertsGate | ExpertsUp | ExpertsDown)) => {
            let one = |e| {
                load(
                    ws,
                    WeightId::Expert {
                        layer: l,
                        expert: e,
                        which: w,
                    },
                    scale,
                )
            };
            let experts = (0..ws.cfg.n_routed_experts)
                .map(|e| one(e).map(|(v, s)| (v, [&[1u64][..], &s].concat())))
                .collect::<Result<Vec<_>>>()?;
            concat(experts, 0)
        }
        WeightId::Layer(l, ExpertsGateUp) => concat(
            vec![
                load(ws, WeightId::Layer(l, ExpertsGate), scale)?,
                load(ws, WeightId::Layer(l, ExpertsUp), scale)?,
            ],
            1,
        ),
        _ if scale => bail!("the model holds no `{name}{SCALE_SUFFIX}` (not an FP8 checkpoint)"),
        _ => bail!("the model holds no `{name}`"),
    }
}

/// The shared MLP's weight a stacked experts' part takes its fused shared experts from, and
/// the axis along which it holds one expert after another (the intermediate).
fn shared_expert(id: WeightId) -> Option<(WeightId, usize)> {
    let WeightId::Layer(l, role) = id else {
        return None;
    };
    match role {
        ExpertsGate => Some((WeightId::Layer(l, SharedGate), 0)),
        ExpertsUp => Some((WeightId::Layer(l, SharedUp), 0)),
        ExpertsDown => Some((WeightId::Layer(l, SharedDown), 1)),
        _ => None,
    }
}

/// A row-major tensor cut into `n` equal parts along `axis` (the inverse of [`concat()`]).
fn split(
    values: &[f32],
    shape: &[u64],
    axis: usize,
    n: usize,
) -> Result<Vec<(Vec<f32>, Vec<u64>)>> {
    let along = shape.get(axis).copied().unwrap_or(0) as usize;
    if n == 0 || !along.is_multiple_of(n) {
        bail!("shape {shape:?} does not split into {n} along axis {axis}");
    }
    let outer = shape[..axis].iter().product::<u64>().max(1) as usize;
    let chunk = values.len() / outer / n;
    let mut part_shape = shape.to_vec();
    part_shape[axis] = (along / n) as u64;
    Ok((0..n)
        .map(|k| {
            let v = (0..outer)
                .flat_map(|o| {
                    let start = (o * n + k) * chunk;
                    values[start..start + chunk].iter().copied()
                })
                .collect();
            (v, part_shape.clone())
        })
        .collect())
}

/// Tensors equal in shape but along `axis`, stacked along it (row-major).
fn concat(mut parts: Vec<(Vec<f32>, Vec<u64>)>, axis: usize) -> Result<(Vec<f32>, Vec<u64>)> {
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    let first = parts[0].1.clone();
    let fits = |s: &[u64]| {
        s.len() == first.len()
            && axis < s.len()
            && (0..s.len()).all(|a| a == axis || s[a] == first[a])
    };
    if !parts.iter().all(|(_, s)| fits(s)) {
        let shapes: Vec<_> = parts.iter().map(|p| &p.1).collect();
        bail!("parts of shapes {shapes:?} do not stack along axis {axis}");
    }
    let outer = first[..axis].iter().product::<u64>().max(1) as usize;
    let mut shape = first;
    shape[axis] = parts.iter().map(|p| p.1[axis]).sum();
    let mut out = Vec::with_capacity(parts.iter().map(|p| p.0.len()).sum());
    for o in 0..outer {
        for (v, _) in &parts {
            let chunk = v.len() / outer;
            out.extend_from_slice(&v[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok((out, shape))
}

/// A manifest weight's full values, and how the plan lays them out.
struct Full {
    values: Vec<f32>,
    shape: Vec<u64>,
    layout: Layout,
}

impl Full {
    fn load(ws: &WeightSource, target: &Target, tp: u64, ep: bool) -> Result<Full> {
        let (values, shape) = target.load(ws)?;
        Ok(Full {
            values,
            shape,
            layout: target.layout(ws, tp, ep),
        })
    }

    fn reference<'a>(&'a self, label: &'a str, tp: u64) -> Result<Reference<'a>> {
        match self.layout {
            Layout::Placed(p) => Reference::new(label, &self.values, &self.shape, p, tp),
            Layout::Owner(o) => Reference::owned(label, &self.values, &self.shape, o, tp),
        }
    }
}

/// One rank's shard of one weight, judged.
#[derive(Clone, Debug)]
pub struct CheckedShard {
    pub weight: String,
    /// The checkpoint weight (the first part of a merged one).
    pub id: WeightId,
    pub rank: u64,
    /// `rows 48..96`, `all`, `none`.
    pub expected: String,
    /// The same for what the rank holds; `None` when it matches no slice.
    pub found: Option<String>,
    pub basis: Basis,
    /// `None` when the shard is what the plan gives.
    pub class: Option<FaultClass>,
    pub evidence: String,
    /// The engine's dequantization of a quantized shard, where the manifest gives it.
    pub dequant: Option<DequantCheck>,
}

/// A manifest against the plan.
#[derive(Clone, Debug)]
pub struct ManifestCheck {
    pub shards: Vec<CheckedShard>,
    /// Weights of the forward's layers with the ranks the plan gives them to whose manifest
    /// lists none of them (MTP layers, which vLLM loads only to speculate, are not expected).
    pub not_in_manifest: Vec<(String, WeightId, Vec<u64>)>,
}

/// One weight of a manifest: its name, what it resolves to, and each rank's entry.
struct Listed<'m> {
    name: &'m str,
    target: Target,
    shards: Vec<(u64, &'m ShardEntry)>,
}

/// The manifest's entries weight by weight, in order of first appearance; an error for a name
/// that is no GLM-5 weight.
fn by_weight<'m>(m: &'m ShardManifest, cfg: &Glm5Config) -> Result<Vec<Listed<'m>>> {
    let mut weights: Vec<Listed> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (i, r) in m.ranks.iter().enumerate() {
        for (j, w) in r.weights.iter().enumerate() {
            let k = match index.get(w.name.as_str()) {
                Some(&k) => k,
                None => {
                    let target = Target::resolve(&w.name)
                        .ok_or_else(|| {
                            anyhow!(
                                "ranks[{i}].weights[{j}].name: `{}` is not a GLM-5 weight ({KNOWN})",
                                w.name
                            )
                        })?
                        .fused(cfg, &w.shape);
                    weights.push(Listed {
                        name: &w.name,
                        target,
                        shards: Vec::new(),
                    });
                    index.insert(&w.name, weights.len() - 1);
                    weights.len() - 1
                }
            };
            weights[k].shards.push((r.rank, w));
        }
    }
    Ok(weights)
}

/// Check every shard `m` lists against the plan at its TP and EP, one weight in memory at a
/// time. Errors: a degree the model does not split into, a name that is no GLM-5 weight, a
/// weight the model does not hold.
pub fn check(ws: &WeightSource, m: &ShardManifest) -> Result<ManifestCheck> {
    check_degree(&ws.cfg, m.tp)?;
    let weights = by_weight(m, &ws.cfg)?;
    let shards = check_listed(ws, m, &weights)?;
    let covered: BTreeSet<(u64, WeightId)> = weights
        .iter()
        .flat_map(|w| {
            let ids = w.target.covers();
            w.shards
                .iter()
                .flat_map(move |(r, _)| ids.clone().into_iter().map(move |id| (*r, id)))
        })
        .collect();
    let has = |r: u64, id: WeightId| {
        covered.contains(&(r, id))
            || matches!(id, WeightId::Expert { layer, which, .. }
                        if covered.contains(&(r, WeightId::Layer(layer, which))))
    };
    let not_in_manifest = plan_weights(ws)
        .into_iter()
        .filter_map(|(name, id)| {
            let layout = Target {
                parts: vec![id],
                axis: 0,
                scale: false,
                shared: 0,
            }
            .layout(ws, m.tp, m.ep);
            let ranks: Vec<u64> = (0..m.tp)
                .filter(|&r| !matches!(layout, Layout::Owner(o) if o != r))
                .filter(|&r| !normal(id).into_iter().all(|n| has(r, n)))
                .collect();
            (!ranks.is_empty()).then_some((name, id, ranks))
        })
        .collect();
    Ok(ManifestCheck {
        shards,
        not_in_manifest,
    })
}

/// The shards of the listed weights judged against the plan, one weight in memory at a time.
fn check_listed(
    ws: &WeightSource,
    m: &ShardManifest,
    weights: &[Listed<'_>],
) -> Result<Vec<CheckedShard>> {
    let mut shards = Vec::new();
    for Listed {
        name,
        target,
        shards: entries,
    } in weights
    {
        let (quantized, entries): (Vec<_>, Vec<_>) =
            entries.iter().partition(|(_, e)| e.is_quantized());
        if !quantized.is_empty() {
            shards.extend(check_quantized(ws, m, name, target, &quantized)?);
        }
        if entries.is_empty() {
            continue;
        }
        let full = Full::load(ws, target, m.tp, m.ep).with_context(|| name.to_string())?;
        let reference = full.reference(name, m.tp)?;
        let mut verdicts = entries
            .iter()
            .map(|(r, e)| reference.identify(*r, &e.observed()))
            .collect::<Result<Vec<_>>>()?;
        reference.same_block_everywhere(&mut verdicts);
        shards.extend(verdicts.into_iter().map(|v| {
            CheckedShard {
                weight: name.to_string(),
                id: target.parts[0],
                rank: v.rank,
                expected: v
                    .expected
                    .as_ref()
                    .map_or("none".into(), |s| reference.describe(s)),
                found: v.found.as_ref().map(|s| reference.describe(s)),
                basis: v.basis,
                class: v.class,
                evidence: v.evidence,
                dequant: None,
            }
        }));
    }
    Ok(shards)
}

/// Quantized entries of one weight: their bytes against the file tensor's, which must be the
/// weight's one GGUF tensor (llama.cpp's split kv_b has no bytes of `kv_b_proj`).
fn check_quantized(
    ws: &WeightSource,
    m: &ShardManifest,
    name: &str,
    target: &Target,
    entries: &[&(u64, &ShardEntry)],
) -> Result<Vec<CheckedShard>> {
    let [id] = target.parts[..] else {
        bail!("{name}: a merged name holds no one GGUF tensor's bytes; list each part");
    };
    let file_name = id.gguf_name();
    let t = ws.files.get(&file_name).ok_or_else(|| {
        anyhow!(
            "{name}: quantized bytes, but the model stores no `{file_name}` to compare them with"
        )
    })?;
    let shards: Vec<QuantShard> = entries.iter().map(|(r, e)| QuantShard::of(e, *r)).collect();
    let verdicts = crate::shard::bytes::identify(&ws.files, t, id, name, m.tp, m.ep, &shards)
        .with_context(|| name.to_string())?;
    Ok(verdicts
        .into_iter()
        .map(|v| CheckedShard {
            weight: name.to_string(),
            id,
            rank: v.rank,
            expected: v.expected,
            found: v.found,
            basis: Basis::Hash,
            class: v.class,
            evidence: v.evidence,
            dequant: v.dequant,
        })
        .collect())
}

/// The shards of the manifest's weights that hold any of `ids`, judged against the plan (the
/// weights a divergent stage reads, in a bisect drill-down).
pub fn check_only(
    ws: &WeightSource,
    m: &ShardManifest,
    ids: &[WeightId],
) -> Result<Vec<CheckedShard>> {
    check_degree(&ws.cfg, m.tp)?;
    let weights: Vec<Listed> = by_weight(m, &ws.cfg)?
        .into_iter()
        .filter(|w| w.target.covers().iter().any(|id| ids.contains(id)))
        .collect();
    check_listed(ws, m, &weights)
}

/// The model's tensors of its forward layers and outside them, by name and role (MTP layers
/// and FP8 scales left out).
fn plan_weights(ws: &WeightSource) -> Vec<(String, WeightId)> {
    ws.files
        .tensors()
        .iter()
        .filter_map(|t| {
            let id = match family(ws) {
                Family::Gguf => WeightId::from_gguf(&t.name),
                Family::Hf => WeightId::from_hf(&t.name),
            }?;
            let forward = id.layer().is_none_or(|l| l < ws.cfg.num_hidden_layers);
            forward.then(|| (t.name.clone(), id))
        })
        .collect()
}

/// Each rank's correct entry for manifest weight `name` at TP `tp` (ranks the plan gives
/// nothing are left out).
pub fn planned_entries(
    ws: &WeightSource,
    name: &str,
    tp: u64,
    ep: bool,
    dtype: Dtype,
) -> Result<Vec<(u64, ShardEntry)>> {
    let target = Target::resolve(name).ok_or_else(|| anyhow!("`{name}`: {KNOWN}"))?;
    let full = Full::load(ws, &target, tp, ep).with_context(|| name.to_string())?;
    let reference = full.reference(name, tp)?;
    Ok((0..tp)
        .filter_map(|r| {
            let slice = reference.planned(r)?;
            let values = reference.values_of(&slice);
            Some((
                r,
                ShardEntry::of(name, reference.shape_of(&slice), &values, dtype),
            ))
        })
        .collect())
}

/// The manifest a correct engine writes at TP `tp` (EP with `ep`), holding weights in
/// `dtype`: every weight of the forward's layers under its checkpoint name, each rank's
/// planned slice with statistics and hash. One weight in memory at a time.
pub fn plan_manifest(ws: &WeightSource, tp: u64, ep: bool, dtype: Dtype) -> Result<ShardManifest> {
    check_degree(&ws.cfg, tp)?;
    let mut ranks: Vec<RankShards> = (0..tp)
        .map(|rank| RankShards {
            rank,
            weights: Vec::new(),
        })
        .collect();
    for (name, _) in plan_weights(ws) {
        for (r, entry) in planned_entries(ws, &name, tp, ep, dtype)? {
            ranks[r as usize].weights.push(entry);
        }
    }
    let producer = serde_json::json!({"name": "glmcheck", "version": env!("CARGO_PKG_VERSION"),
                                      "what": "the plan"});
    Ok(ShardManifest {
        format: FORMAT.into(),
        version: VERSION,
        producer: producer.as_object().cloned().unwrap_or_default(),
        tp,
        ep,
        ranks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_resolve_to_checkpoint_weights_and_vllm_merges() {
        let t = Target::resolve("model.layers.2.mlp.gate_up_proj.weight").unwrap();
        assert_eq!(
            (t.parts, t.axis),
            (vec![WeightId::Layer(2, Gate), WeightId::Layer(2, Up)], 0)
        );
        let t = Target::resolve("blk.0.attn_k_b.weight").unwrap();
        assert_eq!(t.covers(), vec![WeightId::Layer(0, KvB)]);
        assert!(Target::resolve("model.layers.x.mlp.gate_up_proj.weight").is_none());
        assert!(Target::resolve("model.layers.0.mlp.fancy_proj.weight").is_none());
    }

    #[test]
    fn concat_stacks_along_an_inner_axis() {
        let a = ((0..4).map(|v| v as f32).collect(), vec![2, 1, 2]);
        let b = ((4..8).map(|v| v as f32).collect(), vec![2, 1, 2]);
        let (v, s) = concat(vec![a, b], 1).unwrap();
        assert_eq!(s, vec![2, 2, 2]);
        assert_eq!(v, vec![0., 1., 4., 5., 2., 3., 6., 7.]);
        let c = (vec![0.0; 3], vec![3]);
        assert!(concat(vec![c.clone(), (vec![0.0; 4], vec![2, 2])], 0).is_err());
    }

    #[test]
    fn split_undoes_concat_along_either_axis() {
        let whole: Vec<f32> = (0..12).map(|v| v as f32).collect();
        for axis in [0, 1] {
            let parts = split(&whole, &[2, 6], axis, 2).unwrap();
            assert_eq!(concat(parts, axis).unwrap(), (whole.clone(), vec![2, 6]));
        }
        let cols = split(&whole, &[2, 6], 1, 3).unwrap();
        assert_eq!(cols[1], (vec![2., 3., 8., 9.], vec![2, 2]));
        assert!(split(&whole, &[2, 6], 1, 4).is_err());
    }

    #[test]
    fn stacked_experts_count_fused_shared_experts_by_their_first_dimension() {
        let cfg = Glm5Config::glm5();
        let (routed, shared) = (cfg.n_routed_experts, cfg.n_shared_experts);
        let w13 = || Target::resolve("model.layers.3.mlp.experts.w13_weight").unwrap();
        assert_eq!(w13().fused(&cfg, &[routed, 8, 16]).shared, 0);
        let fused = w13().fused(&cfg, &[routed + shared, 8, 16]);
        assert_eq!(fused.shared, shared);
        assert!(fused.covers().contains(&WeightId::Layer(3, SharedGate)));
        let dense = Target::resolve("model.layers.0.mlp.gate_up_proj.weight").unwrap();
        assert_eq!(dense.fused(&cfg, &[routed + shared, 8, 16]).shared, 0);
    }
}
