//! `glmcheck inspect MODEL`: what a checkpoint holds and whether it is a complete GLM-5.

use std::collections::BTreeMap;

use serde_json::json;

use super::output::{bytes, progress, shape, table};
use super::{ModelArg, Outcome};
use crate::model::names::WeightId;
use crate::model::schema::{self, Family, SchemaReport};
use crate::model::Glm5Config;
use crate::pipeline::model::glm5_config;
use crate::shard::bytes_per_rank;
use crate::weights::ModelFiles;

/// Tensor-parallel sizes whose per-rank bytes are reported.
const TP_SIZES: [u64; 4] = [1, 2, 4, 8];
/// Terminal listings stop after this many tensors unless `--all`.
const LIST_LIMIT: usize = 40;

#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// List every tensor and metadata key (by default long listings are cut).
    #[arg(long)]
    pub all: bool,
}

/// Per storage type: tensors, elements, bytes.
fn quant_histogram(files: &ModelFiles) -> BTreeMap<String, (u64, u64, u64)> {
    let mut h = BTreeMap::new();
    for t in files.tensors() {
        let e = h.entry(t.encoding.name().to_string()).or_insert((0, 0, 0));
        *e = (e.0 + 1, e.1 + t.numel(), e.2 + t.nbytes);
    }
    h
}

fn rank_bytes(files: &ModelFiles, family: Family) -> Vec<(u64, u64)> {
    let roles: Vec<(Option<WeightId>, u64)> = files
        .tensors()
        .iter()
        .map(|t| (schema::role(family, &t.name), t.nbytes))
        .collect();
    TP_SIZES
        .iter()
        .map(|&tp| (tp, bytes_per_rank(&roles, tp)))
        .collect()
}

pub fn run(args: InspectArgs) -> anyhow::Result<Outcome> {
    let quiet = args.model.json;
    let spinner = progress(1, quiet, "reading headers");
    let files = ModelFiles::open(&args.model.model)?;
    spinner.finish_and_clear();
    let config = glm5_config(&files)?;
    let family = config
        .as_ref()
        .map(|c| c.1)
        .unwrap_or(if files.gguf().is_some() {
            Family::Gguf
        } else {
            Family::Hf
        });
    let report = config
        .as_ref()
        .map(|(cfg, fam)| schema::check(cfg, *fam, files.tensors()));
    let hist = quant_histogram(&files);
    let ranks = rank_bytes(&files, family);
    if args.model.json {
        print_json(
            &files,
            config.as_ref().map(|c| &c.0),
            report.as_ref(),
            &hist,
            &ranks,
        )?;
    } else {
        print_text(
            &files,
            config.as_ref().map(|c| &c.0),
            report.as_ref(),
            &hist,
            &ranks,
            args.all,
        );
    }
    Ok(match report {
        Some(r) if !r.ok() => Outcome::Fail,
        _ => Outcome::Pass,
    })
}

fn metadata_json(files: &ModelFiles) -> serde_json::Value {
    match files.gguf() {
        Some(g) => g
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), v.to_json(16)))
            .collect::<serde_json::Map<_, _>>()
            .into(),
        None => json!({}),
    }
}

fn print_json(
    files: &ModelFiles,
    cfg: Option<&Glm5Config>,
    report: Option<&SchemaReport>,
    hist: &BTreeMap<String, (u64, u64, u64)>,
    ranks: &[(u64, u64)],
) -> anyhow::Result<()> {
    let tensors: Vec<_> = files
        .tensors()
        .iter()
        .map(|t| json!({"name": t.name, "type": t.encoding.name(), "shape": t.shape, "bytes": t.nbytes, "file": t.file}))
        .collect();
    let out = json!({
        "path": files.path,
        "format": files.format(),
        "files": files.files(),
        "architecture": files.gguf().and_then(|g| g.architecture()),
        "metadata": metadata_json(files),
        "config": cfg,
        "tensors": tensors,
        "schema": report.map(|r| json!({"ok": r.ok(), "report": r})),
        "quant_types": hist.iter().map(|(ty, (n, el, b))| json!({"type": ty, "tensors": n, "elements": el, "bytes": b})).collect::<Vec<_>>(),
        "bytes_per_rank": ranks.iter().map(|(tp, b)| json!({"tp": tp, "bytes": b})).collect::<Vec<_>>(),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn print_text(
    files: &ModelFiles,
    cfg: Option<&Glm5Config>,
    report: Option<&SchemaReport>,
    hist: &BTreeMap<String, (u64, u64, u64)>,
    ranks: &[(u64, u64)],
    all: bool,
) {
    let total: u64 = files.tensors().iter().map(|t| t.nbytes).sum();
    println!(
        "{}: {}, {} tensors, {}",
        files.path.display(),
        files.format(),
        files.tensors().len(),
        bytes(total)
    );
    if let Some(g) = files.gguf() {
        println!("\nmetadata ({} keys)", g.metadata().len());
        for (k, v) in g
            .metadata()
            .iter()
            .take(if all { usize::MAX } else { LIST_LIMIT })
        {
            println!("  {k} = {v}");
        }
        if !all && g.metadata().len() > LIST_LIMIT {
            println!(
                "  … {} more (--all lists them)",
                g.metadata().len() - LIST_LIMIT
            );
        }
    }
    match cfg {
        Some(c) => {
            println!("\nGLM-5 config");
            let v = serde_json::to_value(c).unwrap_or_default();
            for (k, val) in v.as_object().into_iter().flatten().filter(|(k, _)| *k != "indexer_types") {
                println!("  {k} = {val}");
            }
            let shared = c.indexer_types.iter().filter(|k| **k == crate::model::config::IndexerKind::Shared).count();
            println!("  indexer layers = {} full, {shared} shared", c.indexer_types.len() - shared);
        }
        None => println!("\nnot a GLM-5 checkpoint (no glm-dsa architecture, no glm_moe_dsa or deepseek_v3/v32 config.json): schema check skipped"),
    }
    let mut t = table(&["tensor", "type", "shape", "bytes"]);
    for e in files
        .tensors()
        .iter()
        .take(if all { usize::MAX } else { LIST_LIMIT })
    {
        t.add_row(vec![
            e.name.clone(),
            e.encoding.name().to_string(),
            shape(&e.shape),
            bytes(e.nbytes),
        ]);
    }
    println!("\ntensors\n{t}");
    if !all && files.tensors().len() > LIST_LIMIT {
        println!(
            "… {} more (--all lists them)",
            files.tensors().len() - LIST_LIMIT
        );
    }
    if let Some(r) = report {
        print_schema(r);
    }
    let mut h = table(&["type", "tensors", "elements", "bytes", "share"]);
    for (ty, (n, el, b)) in hist {
        h.add_row(vec![
            ty.clone(),
            n.to_string(),
            el.to_string(),
            bytes(*b),
            format!("{:.1}%", 100.0 * *b as f64 / total.max(1) as f64),
        ]);
    }
    println!("\nstorage types\n{h}");
    let mut r = table(&["TP", "bytes per rank"]);
    for (tp, b) in ranks {
        r.add_row(vec![tp.to_string(), bytes(*b)]);
    }
    println!("\nbytes per rank (vLLM's plan: attention heads, MLPs, experts, vocab sharded; the rest replicated)\n{r}");
}

fn print_schema(r: &SchemaReport) {
    let verdict = if r.ok() { "OK" } else { "FAILED" };
    println!(
        "\nschema check: {verdict} ({} expected, {} in file; kv_b {:?}, experts {:?}{})",
        r.expected,
        r.found,
        r.layout.kv_b,
        r.layout.experts,
        if r.mtp_layers.is_empty() {
            String::new()
        } else {
            format!(
                "; MTP layers {:?} recognised, left out of the forward",
                r.mtp_layers
            )
        }
    );
    let list = |title: &str, items: Vec<String>| {
        if !items.is_empty() {
            println!("  {title} ({}):", items.len());
            for i in items.iter().take(LIST_LIMIT) {
                println!("    {i}");
            }
            if items.len() > LIST_LIMIT {
                println!("    … {} more", items.len() - LIST_LIMIT);
            }
        }
    };
    list("missing", r.missing.clone());
    list("unexpected", r.unexpected.clone());
    list(
        "wrong shape",
        r.wrong_shape
            .iter()
            .map(|w| format!("{}: expected {:?}, found {:?}", w.name, w.expected, w.found))
            .collect(),
    );
}
