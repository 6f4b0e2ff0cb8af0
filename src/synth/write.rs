//! Writing a planned synthetic model: llama.cpp's `glm-dsa` GGUF, or a Hugging Face folder.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use rayon::prelude::*;

use super::fp8;
use super::plan::{plan, rows, Planned};
use super::weights::WeightGen;
use super::{gguf_metadata, SynthSpec};
use crate::model::schema::{ExpertForm, Family, KvBForm, Layout};
use crate::rng::SplitMix;
use crate::weights::fp8::ScaleFmt;
use crate::weights::gguf::writer::GgufWriter;
use crate::weights::quantize::{self, random_blocks};
use crate::weights::safetensors_writer::{SafetensorsStreamWriter, StoreAs};
use crate::weights::GgmlType;

/// Values generated and encoded at a time (whole rows).
const CHUNK_ELEMS: u64 = 1 << 22;
/// Rows per parallel generation task.
const TASK_ROWS: u64 = 64;

/// What was written, for the summary line and `--json`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Written {
    pub files: Vec<std::path::PathBuf>,
    pub tensors: usize,
    pub bytes: u64,
    pub types: BTreeMap<String, usize>,
    /// Tensors written as random valid blocks rather than quantized weights.
    pub random_blocks: Vec<String>,
}

/// Row ranges of `p` in writing order, each at most [`CHUNK_ELEMS`] values.
fn chunks(p: &Planned) -> impl Iterator<Item = std::ops::Range<u64>> {
    let step = (CHUNK_ELEMS / p.row_len().max(1)).max(1);
    let rows = p.rows();
    (0..rows.div_ceil(step)).map(move |k| k * step..((k + 1) * step).min(rows))
}

/// Rows of `p`, generated in parallel (each row has its own random stream, so the result does
/// not depend on the split).
fn values(spec: &SynthSpec, gen: &WeightGen, p: &Planned, range: std::ops::Range<u64>) -> Vec<f32> {
    let starts: Vec<u64> = (range.start..range.end)
        .step_by(TASK_ROWS as usize)
        .collect();
    starts
        .par_iter()
        .map(|&s| rows(gen, &spec.cfg, p, s..(s + TASK_ROWS).min(range.end)))
        .collect::<Vec<_>>()
        .concat()
}

/// Valid random blocks for chunk `k` (rows `range`) of `p`, made in parallel: each task of
/// [`TASK_ROWS`] rows has its own stream, so the bytes do not depend on the thread count.
fn fast_blocks(
    spec: &SynthSpec,
    p: &Planned,
    ty: GgmlType,
    k: usize,
    range: std::ops::Range<u64>,
) -> Vec<u8> {
    let blocks_per_row = p.row_len() / ty.block_size() as u64;
    let starts: Vec<u64> = (range.start..range.end)
        .step_by(TASK_ROWS as usize)
        .collect();
    starts
        .par_iter()
        .map(|&s| {
            let rows = (s + TASK_ROWS).min(range.end) - s;
            let key = format!("{}#{k}", p.name);
            random_blocks(
                ty,
                (rows * blocks_per_row) as usize,
                &mut SplitMix::for_row(spec.seed, &key, s),
            )
        })
        .collect::<Vec<_>>()
        .concat()
}

/// Write the GGUF form to `path`.
pub fn write_gguf(spec: &SynthSpec, path: &Path) -> std::io::Result<Written> {
    if spec.mix.fp8_scales().is_some() {
        return Err(std::io::Error::other(format!(
            "--quant {} is a Hugging Face layout (GLM-5-FP8's, DeepSeek-V3.1's): give --format hf",
            spec.mix
        )));
    }
    let layout = Layout {
        family: Family::Gguf,
        kv_b: KvBForm::Split,
        experts: ExpertForm::Stacked,
    };
    let planned = plan(&spec.cfg, layout);
    let types: Vec<GgmlType> = planned.iter().map(|p| spec.storage_type(p)).collect();
    let mut w = GgufWriter::new();
    let tokenizer = spec.tokenizer().map_err(std::io::Error::other)?;
    for (k, v) in gguf_metadata(spec, &tokenizer) {
        w.metadata(k, v);
    }
    for (p, ty) in planned.iter().zip(&types) {
        w.declare(&p.name, *ty, &p.shape);
    }
    // Random blocks in --fast mode, and for types nobody has a quantizer for (IQ2/IQ3/IQ1…).
    let random: Vec<bool> = types
        .iter()
        .map(|&ty| (spec.fast && ty != GgmlType::F32) || !quantize::has_quantizer(ty))
        .collect();
    let gen = spec.weight_gen();
    w.write_streaming(path, |i, out: &mut (dyn Write + Send)| {
        let (p, ty) = (&planned[i], types[i]);
        let encode = |k: usize, range: std::ops::Range<u64>| -> std::io::Result<Vec<u8>> {
            if random[i] {
                Ok(fast_blocks(spec, p, ty, k, range))
            } else {
                quantize::quantize(ty, &values(spec, &gen, p, range), p.row_len() as usize)
                    .map_err(std::io::Error::other)
            }
        };
        // Encode chunk k+1 while chunk k is being written.
        let mut pending = chunks(p).enumerate().peekable();
        let mut current = match pending.next() {
            Some((k, range)) => encode(k, range)?,
            None => return Ok(()),
        };
        loop {
            let next = pending.next();
            let (written, encoded) = rayon::join(
                || out.write_all(&current),
                || next.map(|(k, r)| encode(k, r)),
            );
            written?;
            match encoded {
                Some(bytes) => current = bytes?,
                None => return Ok(()),
            }
        }
    })?;
    let bytes = std::fs::metadata(path)?.len();
    let random_blocks = planned
        .iter()
        .zip(&random)
        .filter(|(_, r)| **r)
        .map(|(p, _)| p.name.clone())
        .collect();
    Ok(Written {
        files: vec![path.to_path_buf()],
        tensors: planned.len(),
        bytes,
        types: histogram(&types),
        random_blocks,
    })
}

fn histogram(types: &[GgmlType]) -> BTreeMap<String, usize> {
    let mut h = BTreeMap::new();
    for t in types {
        *h.entry(t.name().to_string()).or_insert(0) += 1;
    }
    h
}

/// Write the Hugging Face form into folder `dir`: `config.json`, safetensors shards of at most
/// `spec.shard_bytes` (with `model.safetensors.index.json` when there are several), tokenizer.
pub fn write_hf(spec: &SynthSpec, dir: &Path, experts: ExpertForm) -> std::io::Result<Written> {
    let store = spec.hf_store().map_err(std::io::Error::other)?;
    let fp8_scales = spec.mix.fp8_scales();
    let fp8_mix = fp8_scales.is_some();
    if fp8_mix && experts == ExpertForm::FusedGateUp {
        return Err(std::io::Error::other(format!(
            "{}: FP8 checkpoints store their experts one by one; leave --hf-experts at its default",
            spec.mix
        )));
    }
    std::fs::create_dir_all(dir)?;
    let layout = Layout {
        family: Family::Hf,
        kv_b: KvBForm::Whole,
        experts,
    };
    let planned = plan(&spec.cfg, layout);
    // Each planned tensor as stored: (name, type, shape), an FP8 weight followed by its scales.
    let stored = |p: &Planned| -> Vec<(String, StoreAs, Vec<u64>)> {
        if fp8_mix && fp8::is_fp8_weight(&p.name, &p.shape) {
            let scales = fp8::scale_shape(p.shape[0], p.shape[1]);
            vec![
                (p.name.clone(), StoreAs::F8E4M3, p.shape.clone()),
                (format!("{}_scale_inv", p.name), StoreAs::F32, scales),
            ]
        } else {
            vec![(p.name.clone(), store, p.shape.clone())]
        }
    };
    let bytes = |p: &Planned| -> u64 {
        stored(p)
            .iter()
            .map(|(_, s, shape)| s.size() * shape.iter().product::<u64>())
            .sum()
    };
    let shards = shard(&planned, bytes, spec.shard_bytes);
    let names: Vec<String> = (0..shards.len())
        .map(|k| {
            if shards.len() == 1 {
                "model.safetensors".into()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", k + 1, shards.len())
            }
        })
        .collect();
    let gen = spec.weight_gen();
    let metadata: BTreeMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mut weight_map = serde_json::Map::new();
    let mut types = BTreeMap::new();
    for (members, name) in shards.iter().zip(&names) {
        let header: Vec<(String, StoreAs, Vec<u64>)> =
            members.iter().flat_map(|p| stored(p)).collect();
        for (tensor, s, _) in &header {
            *types.entry(format!("{s:?}").to_uppercase()).or_insert(0) += 1;
            weight_map.insert(tensor.clone(), name.clone().into());
        }
        let mut w = SafetensorsStreamWriter::create(&dir.join(name), &header, &metadata)?;
        for p in members {
            if let Some(fmt) = fp8_scales.filter(|_| stored(p).len() > 1) {
                // Scales need whole blocks: the weight is generated whole (one at a time).
                let whole = values(spec, &gen, p, 0..p.rows());
                let (scaled, scales) =
                    fp8::block_scaled(&whole, p.shape[0] as usize, p.shape[1] as usize, fmt);
                w.write(&scaled)?;
                w.write(&scales)?;
            } else {
                for range in chunks(p) {
                    w.write(&values(spec, &gen, p, range))?;
                }
            }
        }
        w.finish()?;
    }
    let total: u64 = planned.iter().map(bytes).sum();
    if shards.len() > 1 {
        let index =
            serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
    }
    let mut config = spec.cfg.to_hf_json();
    config["dtype"] = if store == StoreAs::Bf16 {
        "bfloat16"
    } else {
        "float32"
    }
    .into();
    if let Some(scales) = fp8_scales {
        config["quantization_config"] = serde_json::json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [fp8::BLOCK, fp8::BLOCK],
        });
        if scales == ScaleFmt::Ue8m0 {
            config["quantization_config"]["scale_fmt"] = "ue8m0".into();
        }
    }
    spec.tokenizer_hf_files(dir, &mut config)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let files = names.iter().map(|n| dir.join(n)).collect();
    Ok(Written {
        files,
        tensors: types.values().sum(),
        bytes: total,
        types,
        random_blocks: Vec::new(),
    })
}

/// Consecutive groups of tensors of at most `limit` bytes each (a larger tensor alone).
fn shard(planned: &[Planned], bytes: impl Fn(&Planned) -> u64, limit: u64) -> Vec<Vec<&Planned>> {
    let mut out: Vec<Vec<&Planned>> = vec![Vec::new()];
    let mut size = 0;
    for p in planned {
        let bytes = bytes(p);
        if size > 0 && size + bytes > limit {
            out.push(Vec::new());
            size = 0;
        }
        size += bytes;
        out.last_mut().expect("never empty").push(p);
    }
    out
}
