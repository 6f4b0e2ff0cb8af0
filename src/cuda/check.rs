//! Every tensor's GPU dequantization against the CPU reference's, for each output dtype of the
//! kernels: f32 must be bit-identical to the CPU's f32, bf16 and f16 to the CPU's f32 rounded to
//! nearest even by `half` (where any NaN matches any NaN: the GPU writes f16's canonical one);
//! otherwise the distance in units in the last place and the first block that differs.

use anyhow::Result;
use half::{bf16, f16};
use serde::Serialize;

use super::{DequantOutput, Gpu};
use crate::weights::{quant, Encoding, GgmlType, ModelFiles, TensorEntry};

/// Values dequantized per GPU call: rows of the tensor up to about 16 M values.
const CHUNK_VALUES: u64 = 1 << 24;

/// One tensor dequantized to one output dtype on the GPU, against the CPU.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OutputCheck {
    /// Values whose bits differ.
    pub differing: u64,
    /// The largest distance in units in the last place of the output dtype.
    pub max_ulp: u64,
    /// The first differing value: its flat index and its block.
    pub first: Option<(u64, u64)>,
    /// Bytes of output written, and the kernels' time in milliseconds.
    pub bytes_written: u64,
    pub kernel_ms: f64,
}

/// The 16-bit outputs, under their names in JSON.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HalfOutputs {
    pub bf16: OutputCheck,
    pub f16: OutputCheck,
}

/// One tensor's GPU dequantization against the CPU's, for every output dtype.
#[derive(Clone, Debug, Serialize)]
pub struct GpuCheck {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: String,
    pub values: u64,
    /// Bytes of blocks read (by each output's kernels).
    pub bytes: u64,
    /// The f32 output, its fields beside the tensor's as they were before the 16-bit outputs.
    #[serde(flatten)]
    pub f32: OutputCheck,
    pub outputs: HalfOutputs,
}

impl GpuCheck {
    /// Every output's check under the output's name: f32, bf16, f16.
    pub fn by_output(&self) -> [(&'static str, &OutputCheck); 3] {
        [
            (f32::SUFFIX, &self.f32),
            (bf16::SUFFIX, &self.outputs.bf16),
            (f16::SUFFIX, &self.outputs.f16),
        ]
    }

    /// Whether every output is bit-identical to the CPU's.
    pub fn identical(&self) -> bool {
        self.by_output().iter().all(|(_, o)| o.differing == 0)
    }
}

/// An output dtype as the check compares it with the CPU's f32 values.
trait Compared: DequantOutput {
    /// Bits in its pattern.
    const WIDTH: u32;
    /// `v` rounded to the dtype to nearest even, as its bit pattern: exactly its bits for a
    /// value the GPU wrote (widened to f32).
    fn pattern(v: f32) -> u32;
}

impl Compared for f32 {
    const WIDTH: u32 = 32;
    fn pattern(v: f32) -> u32 {
        v.to_bits()
    }
}

impl Compared for bf16 {
    const WIDTH: u32 = 16;
    fn pattern(v: f32) -> u32 {
        u32::from(bf16::from_f32(v).to_bits())
    }
}

impl Compared for f16 {
    const WIDTH: u32 = 16;
    fn pattern(v: f32) -> u32 {
        u32::from(f16::from_f32(v).to_bits())
    }
}

/// Whether the GPU's value `gpu` of dtype `O` is the CPU's f32 `cpu` rounded to `O`: the same
/// bits, or in a 16-bit dtype both NaN, whatever the payload.
fn same<O: Compared>(gpu: f32, cpu: f32) -> bool {
    O::pattern(gpu) == O::pattern(cpu) || (O::WIDTH < 32 && gpu.is_nan() && cpu.is_nan())
}

/// Distance in units in the last place between two floats given as bit patterns `width` bits
/// wide (32 or 16), sign and magnitude: +0 and -0 are 0 apart, the least positive and negative
/// subnormals 2.
fn ulp(a: u32, b: u32, width: u32) -> u64 {
    let sign = 1u32 << (width - 1);
    let key = |x: u32| {
        let magnitude = i64::from(x & (sign - 1));
        if x & sign != 0 {
            -magnitude
        } else {
            magnitude
        }
    };
    key(a).abs_diff(key(b))
}

/// Blocks `src` of `ty` (values `at..` of their tensor) dequantized to `O` on `gpu`, against
/// the CPU's f32 values `cpu` of them, added to `check`.
fn compare<O: Compared>(
    gpu: &Gpu,
    ty: GgmlType,
    src: &[u8],
    cpu: &[f32],
    at: u64,
    check: &mut OutputCheck,
) -> Result<()> {
    let (on_gpu, ms) = gpu.dequantize::<O>(ty, src, cpu.len())?;
    check.bytes_written += (cpu.len() * std::mem::size_of::<O>()) as u64;
    check.kernel_ms += f64::from(ms);
    for (i, (&g, &c)) in on_gpu.iter().zip(cpu).enumerate() {
        if !same::<O>(g, c) {
            let value = at + i as u64;
            check.differing += 1;
            let distance = ulp(O::pattern(g), O::pattern(c), O::WIDTH);
            check.max_ulp = check.max_ulp.max(distance);
            check
                .first
                .get_or_insert((value, value / ty.block_size() as u64));
        }
    }
    Ok(())
}

/// `t` dequantized on `gpu` to every output dtype and on the CPU, chunk by chunk; `None` when
/// the GPU has no dequantizer for its type.
pub fn check_tensor(gpu: &Gpu, files: &ModelFiles, t: &TensorEntry) -> Result<Option<GpuCheck>> {
    let Encoding::Ggml(ty) = t.encoding else {
        return Ok(None);
    };
    if !gpu.dequantizes(ty) {
        return Ok(None);
    }
    let row_len = t.row_len();
    let row_bytes = ty
        .bytes_for(row_len)
        .ok_or_else(|| anyhow::anyhow!("{}: rows are not whole {ty} blocks", t.name))?;
    let rows_per_chunk = (CHUNK_VALUES / row_len.max(1)).max(1);
    let bytes = files.bytes(t);
    let mut check = GpuCheck {
        name: t.name.clone(),
        ty: ty.name().to_string(),
        values: 0,
        bytes: 0,
        f32: OutputCheck::default(),
        outputs: HalfOutputs::default(),
    };
    let mut start = 0;
    while start < t.rows() {
        let end = (start + rows_per_chunk).min(t.rows());
        let src = &bytes[(start * row_bytes) as usize..(end * row_bytes) as usize];
        let n = ((end - start) * row_len) as usize;
        let mut on_cpu = vec![0f32; n];
        quant::dequantize_rows(ty, src, &mut on_cpu, row_len as usize)?;
        let at = check.values;
        compare::<f32>(gpu, ty, src, &on_cpu, at, &mut check.f32)?;
        compare::<bf16>(gpu, ty, src, &on_cpu, at, &mut check.outputs.bf16)?;
        compare::<f16>(gpu, ty, src, &on_cpu, at, &mut check.outputs.f16)?;
        check.bytes += src.len() as u64;
        check.values += n as u64;
        files.release_rows(t, start..end);
        start = end;
    }
    Ok(Some(check))
}

/// GPU dequantization speed of one type to one output dtype: bytes read and written per kernel
/// second. Fields in the alphabetical order of `dequant --device cuda --json`.
#[derive(Clone, Debug, Serialize)]
pub struct Rate {
    pub gb_in: f64,
    pub gb_out: f64,
    pub gb_per_s: f64,
    pub kernel_ms: f64,
    /// Share of the device-to-device copy bandwidth.
    pub of_copy: f64,
    pub output: &'static str,
    #[serde(rename = "type")]
    pub ty: String,
}

/// Per storage type and output dtype (in [`GpuCheck::by_output`]'s order), the kernels'
/// throughput over the checked tensors.
pub fn throughput(checks: &[GpuCheck], copy_gb_per_s: f64) -> Vec<Rate> {
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
                gb_in: read as f64 / 1e9,
                gb_out: written as f64 / 1e9,
                gb_per_s,
                kernel_ms: ms,
                of_copy: gb_per_s / copy_gb_per_s,
                output,
                ty: ty.to_string(),
            }
        })
        .collect()
}

/// A Q4_K tensor of 512 values (288 bytes) whose bf16 output differs from value 300 on, for the
/// tests of the check and of its report.
#[cfg(test)]
pub(crate) fn q4_k_check() -> GpuCheck {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_keeps_the_f32_fields_and_adds_the_16_bit_outputs() {
        let j = serde_json::to_value(q4_k_check()).unwrap();
        assert_eq!(j["type"], "Q4_K");
        assert_eq!(j["differing"], 0);
        assert_eq!(j["first"], serde_json::Value::Null);
        assert_eq!(j["bytes"], 288);
        assert_eq!(j["kernel_ms"], 1.0);
        assert_eq!(j["outputs"]["bf16"]["differing"], 2);
        assert_eq!(j["outputs"]["bf16"]["first"], serde_json::json!([300, 1]));
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

    #[test]
    fn ulps_count_across_zero() {
        let f = |a: f32, b: f32| ulp(a.to_bits(), b.to_bits(), 32);
        assert_eq!(f(1.0, 1.0), 0);
        assert_eq!(f(1.0, f32::from_bits(1.0f32.to_bits() + 3)), 3);
        assert_eq!(f(0.0, -0.0), 0);
        assert_eq!(f(f32::from_bits(1), -f32::from_bits(1)), 2);
    }

    #[test]
    fn ulps_count_in_16_bit_patterns() {
        let h = |a: f16, b: f16| ulp(a.to_bits().into(), b.to_bits().into(), 16);
        assert_eq!(h(f16::ONE, f16::from_bits(f16::ONE.to_bits() + 5)), 5);
        assert_eq!(h(f16::ZERO, f16::NEG_ZERO), 0);
        assert_eq!(h(f16::from_bits(1), -f16::from_bits(1)), 2);
        let b = |a: bf16, b: bf16| ulp(a.to_bits().into(), b.to_bits().into(), 16);
        assert_eq!(b(bf16::from_bits(2), -bf16::from_bits(1)), 3);
        assert_eq!(b(bf16::MAX, bf16::INFINITY), 1);
    }

    #[test]
    fn sixteen_bit_outputs_match_the_rounded_cpu_value_and_any_nan() {
        // 1 + 2^-8 lies halfway between bf16 1 and its successor (ties to even: 1); f16 holds it.
        let cpu = 1.0 + 2f32.powi(-8);
        assert!(same::<bf16>(1.0, cpu));
        assert!(!same::<bf16>(bf16::from_bits(0x3f81).to_f32(), cpu));
        assert!(same::<f16>(cpu, cpu));
        assert!(!same::<f32>(1.0, cpu));
        let (nan, other_nan) = (f32::NAN, f32::from_bits(0x7fc0_0123));
        assert!(same::<f16>(other_nan, nan) && same::<bf16>(other_nan, nan));
        assert!(!same::<f32>(other_nan, nan));
        assert!(!same::<f16>(nan, 0.0));
    }
}
