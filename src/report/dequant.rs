//! `glmcheck dequant`: each tensor's health after dequantization on the CPU ([`DequantReport`]),
//! or its GPU dequantization against the CPU's ([`GpuReport`]); each as JSON or as terminal
//! tables with a summary.

use std::fmt::Write;
use std::path::PathBuf;

use serde::Serialize;

use super::terminal::{shape, table};
use super::{num, sorted_keys};
use crate::compare::Status;
use crate::cuda::check::{GpuCheck, OutputCheck, Rate};
use crate::weights::health::Health;

/// The chosen tensors dequantized to f32 on the CPU and checked for health.
#[derive(Clone, Debug, Serialize)]
pub struct DequantReport {
    /// Where the f32 tensors were written.
    pub dump: Option<PathBuf>,
    /// `GGUF v3, 2 files`, `safetensors, 1 file`.
    pub format: String,
    pub path: PathBuf,
    pub tensors: Vec<TensorHealth>,
    /// A fail when any tensor holds NaN or Inf.
    pub verdict: Status,
}

/// One tensor's health.
#[derive(Clone, Debug, Serialize)]
pub struct TensorHealth {
    /// `None` for a tensor with no f32 form (skipped).
    #[serde(serialize_with = "sorted_keys")]
    pub health: Option<Health>,
    pub name: String,
    pub shape: Vec<u64>,
    #[serde(rename = "type")]
    pub ty: String,
}

/// Tensors dequantized on one GPU against the CPU, and the kernels' throughput.
#[derive(Clone, Debug, Serialize)]
pub struct GpuReport {
    /// The device-to-device copy bandwidth (bytes read and written per second), in GB/s.
    pub copy_gb_per_s: f64,
    pub device: String,
    /// The tensors the GPU dequantizes.
    #[serde(serialize_with = "sorted_keys")]
    pub tensors: Vec<GpuCheck>,
    pub throughput: Vec<Rate>,
    /// A fail when any output of any tensor differs from the CPU's.
    pub verdict: Status,
    /// `NAME (TYPE)` of the tensors the GPU has no dequantizer for.
    pub without_kernel: Vec<String>,
}

/// `ok`, or what is wrong with the values.
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

/// The health table of the dequantized tensors, a summary, and where the dump went.
pub fn health_text(r: &DequantReport) -> String {
    let mut t = table(&[
        "tensor", "type", "shape", "nan", "inf", "absmax", "fp16 use", "mean", "std", "max σ",
        "health",
    ]);
    let mut skipped = 0;
    for e in &r.tensors {
        let Some(h) = &e.health else {
            skipped += 1;
            continue;
        };
        t.add_row(vec![
            e.name.clone(),
            e.ty.clone(),
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
    let poisoned = r
        .tensors
        .iter()
        .filter(|e| e.health.as_ref().is_some_and(Health::poisoned))
        .count();
    let checked = r.tensors.len() - skipped;
    let mut out = format!(
        "{t}\n{checked} tensors dequantized, {poisoned} with NaN/Inf{}\n",
        if skipped > 0 {
            format!(", {skipped} skipped (no f32 form)")
        } else {
            String::new()
        }
    );
    if let Some(dump) = &r.dump {
        let _ = writeln!(out, "wrote {}", dump.display());
    }
    out
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

/// Each tensor's verdict, the kernels' throughput per type and output, the copy bandwidth and a
/// summary.
pub fn gpu_text(r: &GpuReport) -> String {
    let mut t = table(&[
        "tensor",
        "type",
        "values",
        "GPU against CPU (f32, bf16, f16)",
    ]);
    for c in &r.tensors {
        t.add_row(vec![
            c.name.clone(),
            c.ty.clone(),
            c.values.to_string(),
            verdict(c),
        ]);
    }
    let mut rates = table(&[
        "type",
        "output",
        "GB read",
        "GB written",
        "kernel ms",
        "GB/s",
        "of copy",
    ]);
    for x in &r.throughput {
        rates.add_row(vec![
            x.ty.clone(),
            x.output.to_string(),
            format!("{:.3}", x.gb_in),
            format!("{:.3}", x.gb_out),
            format!("{:.2}", x.kernel_ms),
            format!("{:.0}", x.gb_per_s),
            format!("{:.0}%", 100.0 * x.of_copy),
        ]);
    }
    let failed = r.tensors.iter().filter(|c| !c.identical()).count();
    format!(
        "{t}\n{rates}\ndevice-to-device copy: {:.0} GB/s (read + written)\n{}: {} tensors bit-identical as f32, bf16 and f16, {failed} differ{}\n",
        r.copy_gb_per_s,
        r.device,
        r.tensors.len() - failed,
        if r.without_kernel.is_empty() {
            String::new()
        } else {
            format!("; no GPU kernel for {}", r.without_kernel.join(", "))
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::check::q4_k_check;

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
}
