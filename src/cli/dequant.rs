//! `glmcheck dequant MODEL`: every (selected) tensor dequantized to f32 and checked for health;
//! `--dump` writes the f32 tensors to safetensors under their file names.

use std::path::PathBuf;

use anyhow::Context;
use globset::{Glob, GlobSet, GlobSetBuilder};

use super::{ModelArg, Outcome};
use crate::pipeline::dequant::{dequantize, on_gpu};
use crate::report::dequant::{gpu_text, health_text};
use crate::weights::{ModelFiles, TensorEntry};

#[derive(clap::Args, Debug)]
pub struct DequantArgs {
    #[command(flatten)]
    pub model: ModelArg,
    /// Only tensors whose name matches this glob (repeatable), e.g. `blk.3.*` or `*attn_k_b*`.
    #[arg(long = "tensor", value_name = "GLOB")]
    pub tensors: Vec<String>,
    /// Write the dequantized f32 tensors to this safetensors file, in the file's element order.
    #[arg(long, value_name = "OUT.safetensors")]
    pub dump: Option<PathBuf>,
    /// `cuda`: dequantize every tensor on the GPU too, to f32, bf16 and f16 (kernels compiled by
    /// NVRTC for it), and check each against the CPU reference: f32 bit-identical to the CPU's,
    /// bf16 and f16 to the CPU's f32 rounded to nearest even; or, per output, the ULP distance and
    /// the first block that differs. Types without a GPU kernel are listed.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: Device,
}

/// Where `dequant` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

pub(super) fn selector(globs: &[String]) -> anyhow::Result<Option<GlobSet>> {
    if globs.is_empty() {
        return Ok(None);
    }
    let mut b = GlobSetBuilder::new();
    for g in globs {
        b.add(Glob::new(g).with_context(|| format!("--tensor `{g}`"))?);
    }
    Ok(Some(b.build()?))
}

pub fn run(args: DequantArgs) -> anyhow::Result<Outcome> {
    let files = ModelFiles::open(&args.model.model)?;
    let select = selector(&args.tensors)?;
    let chosen: Vec<&TensorEntry> = files
        .tensors()
        .iter()
        .filter(|t| select.as_ref().is_none_or(|s| s.is_match(&t.name)))
        .collect();
    if chosen.is_empty() {
        anyhow::bail!(
            "{}: no tensor matches {:?}",
            files.path.display(),
            args.tensors
        );
    }
    let json = args.model.json;
    if args.device == Device::Cuda {
        let report = on_gpu(&files, &chosen, json)?;
        if json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        } else {
            print!("{}", gpu_text(&report));
        }
        return Ok(Outcome::from(report.verdict));
    }
    let report = dequantize(&files, &chosen, args.dump.as_deref(), json)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", health_text(&report));
    }
    Ok(Outcome::from(report.verdict))
}
