//! `glmcheck dequant MODEL`: every (selected) tensor dequantized to f32 and checked for health;
//! `--dump` writes the f32 tensors to safetensors under their file names.

use std::path::PathBuf;

use anyhow::Context;
use globset::{Glob, GlobSet, GlobSetBuilder};
use serde_json::json;

use super::output::{num, progress, shape, table};
use super::{ModelArg, Outcome};
use crate::cuda::check::{check_tensor, GpuCheck};
use crate::cuda::Gpu;
use crate::weights::health::{tensor_health, Health};
use crate::weights::safetensors_writer::{SafetensorsStreamWriter, StoreAs};
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
    /// `cuda`: dequantize every tensor on the GPU too (kernels compiled by NVRTC for it) and
    /// check each against the CPU reference: bit-identical f32, or the ULP distance and the first
    /// block that differs. Types without a GPU kernel are listed.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: Device,
}

/// Where `dequant` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

fn selector(globs: &[String]) -> anyhow::Result<Option<GlobSet>> {
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
    if args.device == Device::Cuda {
        return gpu_check(&files, &chosen, args.model.json);
    }
    let bar = progress(chosen.len() as u64, args.model.json, "dequantizing");
    let mut results: Vec<(&TensorEntry, Option<Health>)> = Vec::with_capacity(chosen.len());
    for t in &chosen {
        bar.set_message(t.name.clone());
        let h = if files.can_dequantize(t) {
            Some(tensor_health(&files, t)?)
        } else {
            None
        };
        results.push((t, h));
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(out) = &args.dump {
        dump(&files, &results, out)?;
    }
    let poisoned = results
        .iter()
        .filter(|(_, h)| h.as_ref().is_some_and(Health::poisoned))
        .count();
    if args.model.json {
        print_json(&files, &results, args.dump.as_ref())?;
    } else {
        print_text(&results, poisoned);
        if let Some(out) = &args.dump {
            println!("wrote {}", out.display());
        }
    }
    Ok(if poisoned > 0 {
        Outcome::Fail
    } else {
        Outcome::Pass
    })
}

/// Every chosen tensor dequantized on the GPU against the CPU reference.
fn gpu_check(files: &ModelFiles, chosen: &[&TensorEntry], json: bool) -> anyhow::Result<Outcome> {
    let gpu = Gpu::open(0)?;
    let bar = progress(chosen.len() as u64, json, "dequantizing on the GPU");
    let mut checks = Vec::new();
    let mut without_kernel = Vec::new();
    for t in chosen {
        bar.set_message(t.name.clone());
        match check_tensor(&gpu, files, t)? {
            Some(c) => checks.push(c),
            None => without_kernel.push(format!("{} ({})", t.name, t.encoding.name())),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let failed = checks.iter().filter(|c| !c.identical()).count();
    let copy = gpu.copy_bandwidth()?;
    let rates = throughput(&checks, copy);
    if json {
        let out = json!({"device": gpu.name, "verdict": if failed > 0 { "fail" } else { "pass" },
                         "tensors": checks, "without_kernel": without_kernel,
                         "copy_gb_per_s": copy, "throughput": rates});
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let mut t = table(&["tensor", "type", "values", "GPU against CPU"]);
        for c in &checks {
            let verdict = match c.first {
                None => "bit-identical".to_string(),
                Some((at, block)) => format!(
                    "{} differ, up to {} ulp; first at value {at} (block {block})",
                    c.differing, c.max_ulp
                ),
            };
            t.add_row(vec![
                c.name.clone(),
                c.ty.clone(),
                c.values.to_string(),
                verdict,
            ]);
        }
        println!("{t}");
        let mut r = table(&[
            "type",
            "GB read",
            "GB written",
            "kernel ms",
            "GB/s",
            "of copy",
        ]);
        for x in &rates {
            r.add_row(vec![
                x.ty.clone(),
                format!("{:.3}", x.gb_in),
                format!("{:.3}", x.gb_out),
                format!("{:.2}", x.kernel_ms),
                format!("{:.0}", x.gb_per_s),
                format!("{:.0}%", 100.0 * x.of_copy),
            ]);
        }
        println!("{r}");
        println!("device-to-device copy: {copy:.0} GB/s (read + written)");
        println!(
            "{}: {} tensors bit-identical, {failed} differ{}",
            gpu.name,
            checks.len() - failed,
            if without_kernel.is_empty() {
                String::new()
            } else {
                format!("; no GPU kernel for {}", without_kernel.join(", "))
            }
        );
    }
    Ok(if failed > 0 {
        Outcome::Fail
    } else {
        Outcome::Pass
    })
}

/// GPU dequantization speed of one type: bytes read and written per kernel second.
#[derive(serde::Serialize)]
struct Rate {
    #[serde(rename = "type")]
    ty: String,
    gb_in: f64,
    gb_out: f64,
    kernel_ms: f64,
    gb_per_s: f64,
    /// Share of the device-to-device copy bandwidth.
    of_copy: f64,
}

/// Per storage type, the kernels' throughput over the checked tensors.
fn throughput(checks: &[GpuCheck], copy_gb_per_s: f64) -> Vec<Rate> {
    let mut by_type: std::collections::BTreeMap<&str, (u64, u64, f64)> = Default::default();
    for c in checks {
        let e = by_type.entry(&c.ty).or_default();
        *e = (e.0 + c.bytes, e.1 + 4 * c.values, e.2 + c.kernel_ms);
    }
    by_type
        .into_iter()
        .map(|(ty, (read, written, ms))| {
            let gb_per_s = (read + written) as f64 / (ms.max(1e-9) * 1e-3) / 1e9;
            Rate {
                ty: ty.to_string(),
                gb_in: read as f64 / 1e9,
                gb_out: written as f64 / 1e9,
                kernel_ms: ms,
                gb_per_s,
                of_copy: gb_per_s / copy_gb_per_s,
            }
        })
        .collect()
}

/// Write every dequantized tensor to `out`, chunk by chunk (one chunk in memory at a time).
fn dump(
    files: &ModelFiles,
    results: &[(&TensorEntry, Option<Health>)],
    out: &std::path::Path,
) -> anyhow::Result<()> {
    let chosen: Vec<&TensorEntry> = results
        .iter()
        .filter(|(_, h)| h.is_some())
        .map(|(t, _)| *t)
        .collect();
    let header: Vec<(String, StoreAs, Vec<u64>)> = chosen
        .iter()
        .map(|t| (t.name.clone(), StoreAs::F32, t.shape.clone()))
        .collect();
    let context = || out.display().to_string();
    let producer = [("producer".to_string(), "glmcheck dequant".to_string())].into();
    let mut w = SafetensorsStreamWriter::create(out, &header, &producer).with_context(context)?;
    for t in chosen {
        files.for_each_chunk(t, |values| w.write(values).with_context(context))?;
    }
    w.finish().with_context(context)?;
    Ok(())
}

fn flags(h: &Health) -> String {
    let mut f = Vec::new();
    if h.nan > 0 {
        f.push("NaN");
    }
    if h.inf > 0 {
        f.push("Inf");
    }
    if h.beyond_f16 > 0 {
        f.push("beyond fp16");
    }
    if h.outliers > 0 {
        f.push("outliers");
    }
    if f.is_empty() {
        "ok".into()
    } else {
        f.join(", ")
    }
}

fn print_text(results: &[(&TensorEntry, Option<Health>)], poisoned: usize) {
    let mut t = table(&[
        "tensor", "type", "shape", "nan", "inf", "absmax", "fp16 use", "mean", "std", "max σ",
        "health",
    ]);
    let mut skipped = 0;
    for (e, h) in results {
        let Some(h) = h else {
            skipped += 1;
            continue;
        };
        t.add_row(vec![
            e.name.clone(),
            e.encoding.name().to_string(),
            shape(&e.shape),
            h.nan.to_string(),
            h.inf.to_string(),
            num(h.absmax),
            format!("{:.2e}", h.f16_headroom),
            num(h.mean),
            num(h.std),
            format!("{:.1}", h.max_sigma),
            flags(h),
        ]);
    }
    println!("{t}");
    let checked = results.len() - skipped;
    println!(
        "{checked} tensors dequantized, {poisoned} with NaN/Inf{}",
        if skipped > 0 {
            format!(", {skipped} skipped (no f32 form)")
        } else {
            String::new()
        }
    );
}

fn print_json(
    files: &ModelFiles,
    results: &[(&TensorEntry, Option<Health>)],
    dump: Option<&PathBuf>,
) -> anyhow::Result<()> {
    let tensors: Vec<_> = results
        .iter()
        .map(|(t, h)| json!({"name": t.name, "type": t.encoding.name(), "shape": t.shape, "health": h}))
        .collect();
    let poisoned = results
        .iter()
        .filter(|(_, h)| h.as_ref().is_some_and(Health::poisoned))
        .count();
    let out = json!({
        "path": files.path,
        "format": files.format(),
        "verdict": if poisoned > 0 { "fail" } else { "pass" },
        "tensors": tensors,
        "dump": dump,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
