//! `glmcheck dequant`: tensors dequantized to f32 and checked for health on the CPU
//! ([`dequantize`]), optionally written out; or dequantized on the GPU against the CPU
//! ([`on_gpu`]).

use std::path::Path;

use anyhow::{Context, Result};

use crate::compare::Status;
use crate::cuda::check::{check_tensor, throughput, GpuCheck};
use crate::cuda::Gpu;
use crate::progress::progress;
use crate::report::dequant::{DequantReport, GpuReport, TensorHealth};
use crate::weights::health::{tensor_health, Health};
use crate::weights::safetensors_writer::{SafetensorsStreamWriter, StoreAs};
use crate::weights::{ModelFiles, TensorEntry};

/// Every tensor of `chosen` that has an f32 form dequantized on the CPU and checked for health
/// (a progress bar unless `quiet`); with `dump`, the f32 tensors written there.
pub fn dequantize(
    files: &ModelFiles,
    chosen: &[&TensorEntry],
    dump: Option<&Path>,
    quiet: bool,
) -> Result<DequantReport> {
    let bar = progress(chosen.len() as u64, quiet, "dequantizing");
    let mut tensors = Vec::with_capacity(chosen.len());
    for t in chosen {
        bar.set_message(t.name.clone());
        let health = if files.can_dequantize(t) {
            Some(tensor_health(files, t)?)
        } else {
            None
        };
        tensors.push(TensorHealth {
            health,
            name: t.name.clone(),
            shape: t.shape.clone(),
            ty: t.encoding.name().to_string(),
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(out) = dump {
        let healthy = chosen
            .iter()
            .zip(&tensors)
            .filter(|(_, h)| h.health.is_some());
        write_f32(files, healthy.map(|(t, _)| *t).collect(), out)?;
    }
    let poisoned = tensors
        .iter()
        .any(|t| t.health.as_ref().is_some_and(Health::poisoned));
    Ok(DequantReport {
        dump: dump.map(Path::to_path_buf),
        format: files.format(),
        path: files.path.clone(),
        tensors,
        verdict: if poisoned { Status::Fail } else { Status::Pass },
    })
}

/// Write every tensor of `chosen` dequantized to `out`, chunk by chunk (one chunk in memory at a
/// time).
fn write_f32(files: &ModelFiles, chosen: Vec<&TensorEntry>, out: &Path) -> Result<()> {
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

/// Every tensor of `chosen` dequantized on GPU 0 against the CPU reference (a progress bar
/// unless `quiet`), and the kernels' throughput against the device's copy bandwidth.
pub fn on_gpu(files: &ModelFiles, chosen: &[&TensorEntry], quiet: bool) -> Result<GpuReport> {
    let gpu = Gpu::open(0)?;
    let bar = progress(chosen.len() as u64, quiet, "dequantizing on the GPU");
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
    let copy = gpu.copy_bandwidth()?;
    Ok(GpuReport {
        copy_gb_per_s: copy,
        device: gpu.name.clone(),
        throughput: throughput(&checks, copy),
        verdict: if checks.iter().all(GpuCheck::identical) {
            Status::Pass
        } else {
            Status::Fail
        },
        tensors: checks,
        without_kernel,
    })
}
