//! The stages of an SGLang dump, in the forward's order: each stage's files read (one stage at
//! a time, so memory holds one stage of every rank, whatever the model's size), cut to the
//! stage's shape, its ranks joined, and recorded.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use crate::model::stage::{layer_of, Stage as StageName};
use crate::model::stages::stage_names;
use crate::model::Glm5Config;
use crate::trace::error::{Result, TraceError};
use crate::trace::{Stage, TensorStats, TraceWriter};

use super::names::Split;
use super::pt::{PtTensor, Values};
use super::scan::Entry;
use super::Reader;

/// Which part of a hook's tensor a stage is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// All of it, its ranks related as `Split` says.
    Whole(Split),
    /// Columns `from..to` of its last axis (a fused projection's share), replicated.
    Columns(u64, u64),
}

/// One rank's file of a stage.
#[derive(Clone, Debug)]
pub struct Source {
    pub entry: Entry,
    pub cut: Cut,
}

/// What writing found out beside the stages.
pub struct Written {
    pub producer: Vec<(String, Value)>,
    /// The token positions the logits hold, where they are not every position's.
    pub logits_rows: Option<Vec<u64>>,
}

/// The manifest dtype of the dump's floating-point values (the embedding's).
pub fn dump_dtype(reader: &mut Reader, by_stage: &BTreeMap<String, Vec<Source>>) -> Result<String> {
    let Some(first) = by_stage.get("embed").and_then(|s| s.first()) else {
        return Ok("bf16".into());
    };
    let (t, _) = reader.tensor(&first.entry)?;
    Ok(match t.dtype {
        "float32" => "f32",
        "float64" => "f64",
        "float16" => "f16",
        _ => "bf16",
    }
    .into())
}

/// The stage's whole shape for `t` tokens (`k` the width of a top-k stage as dumped).
fn whole_shape(cfg: &Glm5Config, kind: &str, t: u64, k: u64) -> Vec<u64> {
    let (nh, rope) = (cfg.num_attention_heads, cfg.qk_rope_head_dim);
    match kind {
        "attn.q_a" | "attn.q_a_norm" => vec![t, cfg.q_lora_rank],
        "attn.kv_a" => vec![t, cfg.kv_lora_rank + rope],
        "attn.kv_a_norm" => vec![t, cfg.kv_lora_rank],
        "attn.q" => vec![t, nh, cfg.qk_nope_head_dim + rope],
        "attn.kv" => vec![t, nh, cfg.qk_nope_head_dim + cfg.v_head_dim],
        "attn.q_rope" => vec![t, nh, rope],
        "attn.k_rope" => vec![t, rope],
        "attn.ctx" => vec![t, nh, cfg.v_head_dim],
        "attn.index_topk" => vec![t, k],
        "moe.router_logits" => vec![t, cfg.n_routed_experts],
        "moe.topk_ids" | "moe.topk_weights" => vec![t, cfg.num_experts_per_tok],
        "logits" => vec![t, cfg.vocab_size],
        _ => vec![t, cfg.hidden_size],
    }
}

/// The dims spec of a whole record of stage `kind`.
fn whole_dims(kind: &str) -> &'static str {
    match kind {
        "attn.q" | "attn.kv" | "attn.q_rope" | "attn.ctx" => "t h(tp) d",
        "attn.index_topk" | "moe.topk_ids" | "moe.topk_weights" => "t k",
        "moe.router_logits" => "t e",
        "logits" => "t v(tp)",
        _ => "t d",
    }
}

/// One rank's values of a stage, cut.
fn cut_values(src: &Source, t: PtTensor) -> Result<Values> {
    let Cut::Columns(from, to) = src.cut else {
        return Ok(t.values);
    };
    let width = t.shape.last().copied().unwrap_or(1).max(1);
    if to > width {
        let why = format!(
            "{:?}: fewer than the {to} columns the config's q_lora_rank + kv_lora_rank + \
             qk_rope_head_dim make",
            t.shape
        );
        return Err(TraceError::field(&src.entry.path, "value", why));
    }
    let take = |v: &[f32]| -> Vec<f32> {
        v.chunks(width as usize)
            .flat_map(|row| row[from as usize..to as usize].iter().copied())
            .collect()
    };
    match t.values {
        Values::F32(v) => Ok(Values::F32(take(&v))),
        Values::I32(_) => Err(TraceError::field(&src.entry.path, "value", "integers")),
    }
}

fn len(v: &Values) -> u64 {
    match v {
        Values::F32(v) => v.len() as u64,
        Values::I32(v) => v.len() as u64,
    }
}

fn view(v: &Values) -> Stage<'_> {
    match v {
        Values::F32(v) => Stage::F32(v),
        Values::I32(v) => Stage::I32(v),
    }
}

fn stats(v: &Values) -> TensorStats {
    match v {
        Values::F32(v) => TensorStats::of(v),
        Values::I32(v) => TensorStats::of(v),
    }
}

/// SGLang's DSA indexer row: key positions, -1 padded, to `k` columns (the reference keeps
/// `min(index_topk, tokens)`); None where the ids are not positions (KV-cache slots, which
/// SGLang returns unless `SGLANG_DSA_FUSE_TOPK=0`).
fn positions(ids: &[i32], width: usize, t: u64, k: usize) -> Option<Vec<i32>> {
    let mut out = Vec::with_capacity(ids.len() / width.max(1) * k);
    for row in ids.chunks(width.max(1)) {
        let mut keep: Vec<i32> = row.iter().copied().filter(|&i| i >= 0).collect();
        if keep.iter().any(|&i| i as u64 >= t) || keep.len() > k {
            return None;
        }
        keep.resize(k, -1);
        out.extend(keep);
    }
    Some(out)
}

/// Multiply every value by `factor`.
fn scale(v: &mut Values, factor: f64) {
    if let Values::F32(v) = v {
        v.iter_mut()
            .for_each(|x| *x = (f64::from(*x) * factor) as f32);
    }
}

/// Whether routing weights (rows of `k`) leave `routed_scaling_factor` to the experts' output,
/// as SGLang does unless it fuses the factor into its top-k: normalized rows then sum to 1.
fn factor_left_out(cfg: &Glm5Config, weights: &Values) -> bool {
    let Values::F32(w) = weights else {
        return true;
    };
    if !cfg.norm_topk_prob {
        return true;
    }
    let k = cfg.num_experts_per_tok.max(1) as usize;
    let rows = (w.len() / k).max(1);
    let mean: f64 = w
        .chunks(k)
        .map(|r| r.iter().map(|&x| f64::from(x)).sum::<f64>())
        .sum::<f64>()
        / rows as f64;
    (mean - 1.0).abs() < (mean - cfg.routed_scaling_factor).abs()
}

/// One rank's values of a stage, with the file and the shape it was dumped with.
type Part<'a> = (Values, &'a Source, Vec<u64>);

/// Every rank's values of stage `name`, read and cut; a rank without a file is an error.
fn read_parts<'a>(
    reader: &mut Reader,
    srcs: &'a [Source],
    name: &str,
    tp: u32,
) -> Result<Vec<Part<'a>>> {
    let mut parts = Vec::new();
    for rank in 0..tp {
        let Some(src) = srcs.iter().find(|s| s.entry.rank == rank) else {
            let first = &srcs[0].entry.path;
            let why = format!(
                "no file of rank {rank} for {name} ({} has one)",
                first.display()
            );
            return Err(TraceError::field(first, "rank", why));
        };
        let (tensor, _) = reader.tensor(&src.entry)?;
        let dumped = tensor.shape.clone();
        parts.push((cut_values(src, tensor)?, src, dumped));
    }
    Ok(parts)
}

/// The indexer's ids of every rank as key positions, -1 padded to `k`; false where they are
/// KV-cache slots.
fn to_positions(parts: &mut [Part], t: u64, k: u64) -> Result<bool> {
    for p in parts.iter_mut() {
        let width = p.2.last().copied().unwrap_or(1) as usize;
        let Values::I32(ids) = &p.0 else {
            let why = "the indexer's output is not integer ids";
            return Err(TraceError::field(&p.1.entry.path, "value", why));
        };
        match positions(ids, width, t, k as usize) {
            Some(kept) => p.0 = Values::I32(kept),
            None => return Ok(false),
        }
    }
    Ok(true)
}

/// The first `k` columns of every rank's rows: the routed experts' share of a top-k whose
/// further columns are the shared experts SGLang fuses into the routed experts' kernel.
fn first_columns(parts: &mut [Part], k: usize) {
    for p in parts.iter_mut() {
        let width = p.2.last().copied().unwrap_or(1).max(1) as usize;
        if width < k {
            // Narrower than the routed experts: the shape check after this names the file.
            continue;
        }
        p.0 = match &p.0 {
            Values::F32(v) => Values::F32(v.chunks(width).flat_map(|r| r[..k].to_vec()).collect()),
            Values::I32(v) => Values::I32(v.chunks(width).flat_map(|r| r[..k].to_vec()).collect()),
        };
    }
}

/// Whether the top-k ids hold the shared experts SGLang fuses in (its default for GLM-5 and
/// DeepSeek-V3 on GPUs): columns past `k` whose ids are past the routed experts.
fn shared_fused_in(cfg: &Glm5Config, parts: &[Part]) -> bool {
    let k = cfg.num_experts_per_tok as usize;
    parts.iter().all(|(v, _, dumped)| {
        let width = dumped.last().copied().unwrap_or(1).max(1) as usize;
        let Values::I32(ids) = v else {
            return false;
        };
        width > k
            && ids
                .chunks(width)
                .all(|r| r[k..].iter().all(|&id| id as u64 >= cfg.n_routed_experts))
    })
}

/// A rank's part of a stage of `whole` shape: its heads where they are split.
fn part_shape(
    cfg: &Glm5Config,
    whole: &[u64],
    heads_split: bool,
    tp: u32,
    src: &Source,
) -> Result<Vec<u64>> {
    let mut s = whole.to_vec();
    if heads_split {
        if !cfg.num_attention_heads.is_multiple_of(u64::from(tp)) {
            let why = format!(
                "{} heads do not split over {tp} ranks",
                cfg.num_attention_heads
            );
            return Err(TraceError::field(&src.entry.path, "value", why));
        }
        s[1] /= u64::from(tp);
    }
    Ok(s)
}

/// Record every stage the dump holds, in the forward's order.
pub fn write(
    reader: &mut Reader,
    writer: &mut TraceWriter,
    cfg: &Glm5Config,
    by_stage: &BTreeMap<String, Vec<Source>>,
    (t, tp): (u64, u32),
) -> Result<Written> {
    let mut disagree = Vec::new();
    let mut not_dumped = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let mut logits_rows = None;
    // MoE layers whose top-k holds the shared experts fused in.
    let mut fused = std::collections::BTreeSet::new();
    for name in stage_names(cfg) {
        let Some(srcs) = by_stage.get(&name) else {
            not_dumped.push(name);
            continue;
        };
        let parsed = StageName::parse(&name).filter(|s| layer_of(&s.to_string()).is_some());
        let kind = parsed.as_ref().map_or(name.as_str(), |s| s.kind());
        let mut parts = read_parts(reader, srcs, &name, tp)?;
        let k_index = cfg.index_topk.min(t);
        let mut whole = whole_shape(cfg, kind, t, k_index);
        if kind == "attn.index_topk" && !to_positions(&mut parts, t, k_index)? {
            notes.push(format!(
                "{name}: the indexer returned KV-cache slots, not key positions \
                 (SGLANG_DSA_FUSE_TOPK=0 makes it return positions); not compared"
            ));
            not_dumped.push(name);
            continue;
        }
        let layer = crate::model::stage::layer_of(&name);
        if kind == "moe.topk_ids" && shared_fused_in(cfg, &parts) {
            fused.extend(layer);
            notes.push(format!(
                "{name}: SGLang fused the shared experts into the routed experts (its default \
                 for GLM-5 and DeepSeek-V3 on GPUs): their top-k columns are left out, and the \
                 experts' output, routed and shared experts together, is compared as ffn.out"
            ));
        }
        let in_fused = layer.is_some_and(|l| fused.contains(&l));
        if in_fused && kind == "moe.routed" {
            not_dumped.push(name);
            continue;
        }
        if in_fused && matches!(kind, "moe.topk_ids" | "moe.topk_weights") {
            first_columns(&mut parts, cfg.num_experts_per_tok as usize);
        }
        if kind == "logits" && len(&parts[0].0) == cfg.vocab_size && t > 1 {
            // The logits processor computes the sampled position's row only.
            whole = vec![1, cfg.vocab_size];
            logits_rows = Some(vec![t - 1]);
        }
        // SGLang's experts apply the factor themselves (their output is glmcheck's
        // `moe.routed`); its top-k weights leave it out unless fused into the top-k.
        let rescale = kind == "moe.topk_weights" && cfg.routed_scaling_factor != 1.0;
        if rescale && factor_left_out(cfg, &parts[0].0) {
            for p in parts.iter_mut() {
                scale(&mut p.0, cfg.routed_scaling_factor);
            }
        }
        let split = match srcs[0].cut {
            Cut::Whole(s) => s,
            Cut::Columns(..) => Split::Replicated,
        };
        let heads_split = split == Split::Heads && tp > 1;
        let part = part_shape(cfg, &whole, heads_split, tp, &srcs[0])?;
        for (v, src, dumped) in &parts {
            if len(v) != part.iter().product::<u64>() {
                let why = format!(
                    "{dumped:?} holds {} values; {name} at TP {tp} takes {part:?}",
                    len(v)
                );
                return Err(TraceError::field(&src.entry.path, "value", why));
            }
        }
        let same = parts.iter().all(|p| p.0 == parts[0].0);
        if heads_split || (split == Split::MaybePartial && !same) {
            let dims = if heads_split {
                "t h(tp) d"
            } else {
                "t d partial(tp)"
            };
            for (rank, (v, _, _)) in parts.iter().enumerate() {
                writer.record(&name, &part, dims, Some(rank as u32), view(v))?;
            }
            continue;
        }
        writer.record(&name, &whole, whole_dims(kind), None, view(&parts[0].0))?;
        for (rank, (v, _, _)) in parts.iter().enumerate().skip(1) {
            if *v != parts[0].0 {
                disagree.push(json!({"stage": name, "rank": rank, "stats": stats(v)}));
            }
        }
    }
    Ok(Written {
        producer: vec![
            ("disagree".into(), Value::Array(disagree)),
            ("not_dumped".into(), json!(not_dumped)),
            ("notes".into(), json!(notes)),
        ],
        logits_rows,
    })
}
