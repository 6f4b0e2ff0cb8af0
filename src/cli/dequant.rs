//! `glmcheck dequant MODEL`: every (selected) tensor dequantized to f32 and checked for health;
//! `--dump` writes the f32 tensors to safetensors under their file names.

use std::path::PathBuf;

use anyhow::Context;
use globset::{Glob, GlobSet, GlobSetBuilder};
use serde_json::json;

use super::output::{num, progress, shape, table};
use super::{ModelArg, Outcome};
use crate::cuda::check::{check_tensor, GpuCheck, OutputCheck};
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
        let mut t = table(&[
            "tensor",
            "type",
            "values",
            "GPU against CPU (f32, bf16, f16)",
        ]);
        for c in &checks {
            t.add_row(vec![
                c.name.clone(),
                c.ty.clone(),
                c.values.to_string(),
                verdict(c),
            ]);
        }
        println!("{t}");
        let mut r = table(&[
            "type",
            "output",
            "GB read",
            "GB written",
            "kernel ms",
            "GB/s",
            "of copy",
        ]);
        for x in &rates {
            r.add_row(vec![
                x.ty.clone(),
                x.output.to_string(),
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
            "{}: {} tensors bit-identical as f32, bf16 and f16, {failed} differ{}",
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

/// `bit-identical` when every output of `c` is, else what differs in each output that does.
fn verdict(c: &GpuCheck) -> String {
    if c.identical() {
        return "bit-identical".to_string();
    }
    let differ = |(output, o): (&str, &OutputCheck)| {
        let (at, block) = o.first?;
        Some(format!(
            "{output}: {} differ, up to {} ulp, first at value {at} (block {block})",
            o.differing, o.max_ulp
        ))
    };
    let outputs: Vec<String> = c.by_output().into_iter().filter_map(differ).collect();
    outputs.join("; ")
}

/// GPU dequantization speed of one type to one output dtype: bytes read and written per kernel
/// second.
#[derive(serde::Serialize)]
struct Rate {
    #[serde(rename = "type")]
    ty: String,
    output: &'static str,
    gb_in: f64,
    gb_out: f64,
    kernel_ms: f64,
    gb_per_s: f64,
    /// Share of the device-to-device copy bandwidth.
    of_copy: f64,
}

/// Per storage type and output dtype (in [`GpuCheck::by_output`]'s order), the kernels'
/// throughput over the checked tensors.
fn throughput(checks: &[GpuCheck], copy_gb_per_s: f64) -> Vec<Rate> {
    // Bytes read and written and kernel ms by type, output's place and output.
    type Key<'a> = (&'a str, usize, &'static str);
    let mut sums: std::collections::BTreeMap<Key, (u64, u64, f64)> = Default::default();
    for c in checks {
        for (i, (output, o)) in c.by_output().into_iter().enumerate() {
            let e = sums.entry((&c.ty, i, output)).or_default();
            *e = (e.0 + c.bytes, e.1 + o.bytes_written, e.2 + o.kernel_ms);
        }
    }
    sums.into_iter()
        .map(|((ty, _, output), (read, written, ms))| {
            let gb_per_s = (read + written) as f64 / (ms.max(1e-9) * 1e-3) / 1e9;
            Rate {
                ty: ty.to_string(),
                output,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::check::HalfOutputs;

    /// A Q4_K tensor of 512 values (288 bytes) whose bf16 output differs from value 300 on.
    fn q4_k_check() -> GpuCheck {
        let written = |bytes| OutputCheck {
            bytes_written: bytes,
            kernel_ms: 1.0,
            ..OutputCheck::default()
        };
        let bf16 = OutputCheck {
            differing: 2,
            max_ulp: 1,
            first: Some((300, 1)),
            ..written(1024)
        };
        GpuCheck {
            name: "blk.0.ffn_up.weight".into(),
            ty: "Q4_K".into(),
            values: 512,
            bytes: 288,
            f32: written(2048),
            outputs: HalfOutputs {
                bf16,
                f16: written(1024),
            },
        }
    }

    #[test]
    fn the_verdict_names_the_outputs_that_differ() {
        let mut c = q4_k_check();
        assert!(!c.identical());
        assert_eq!(
            verdict(&c),
            "bf16: 2 differ, up to 1 ulp, first at value 300 (block 1)"
        );
        c.outputs.bf16 = c.outputs.f16.clone();
        assert_eq!(verdict(&c), "bit-identical");
    }

    #[test]
    fn json_keeps_the_f32_fields_and_adds_the_16_bit_outputs() {
        let j = serde_json::to_value(q4_k_check()).unwrap();
        assert_eq!(j["type"], "Q4_K");
        assert_eq!(j["differing"], 0);
        assert_eq!(j["first"], serde_json::Value::Null);
        assert_eq!(j["bytes"], 288);
        assert_eq!(j["kernel_ms"], 1.0);
        assert_eq!(j["outputs"]["bf16"]["differing"], 2);
        assert_eq!(j["outputs"]["bf16"]["first"], json!([300, 1]));
        assert_eq!(j["outputs"]["f16"]["bytes_written"], 1024);
    }

    #[test]
    fn throughput_has_a_row_per_type_and_output() {
        let rates = throughput(&[q4_k_check(), q4_k_check()], 1000.0);
        let rows: Vec<(&str, &str, u64, u64)> = rates
            .iter()
            .map(|r| {
                let bytes = |gb: f64| (gb * 1e9).round() as u64;
                (r.ty.as_str(), r.output, bytes(r.gb_in), bytes(r.gb_out))
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("Q4_K", "f32", 576, 4096),
                ("Q4_K", "bf16", 576, 2048),
                ("Q4_K", "f16", 576, 2048)
            ]
        );
    }
}
