//! Every tensor's GPU dequantization against the CPU reference's: f32 output must be
//! bit-identical; otherwise the distance in units in the last place and the first block that
//! differs.

use anyhow::Result;
use serde::Serialize;

use super::Gpu;
use crate::weights::{quant, Encoding, ModelFiles, TensorEntry};

/// Values dequantized per GPU call: rows of the tensor up to about 16 M values.
const CHUNK_VALUES: u64 = 1 << 24;

/// One tensor's GPU dequantization against the CPU's.
#[derive(Clone, Debug, Serialize)]
pub struct GpuCheck {
    pub name: String,
    #[serde(rename = "type")]
    pub ty: String,
    pub values: u64,
    /// Values whose f32 bits differ.
    pub differing: u64,
    /// The largest distance in units in the last place.
    pub max_ulp: u64,
    /// The first differing value: its flat index and its block.
    pub first: Option<(u64, u64)>,
    /// Bytes of blocks read, and the kernels' time in milliseconds.
    pub bytes: u64,
    pub kernel_ms: f64,
}

impl GpuCheck {
    pub fn identical(&self) -> bool {
        self.differing == 0
    }
}

/// Distance between two f32 in units in the last place (sign-aware).
fn ulp(a: f32, b: f32) -> u64 {
    let key = |x: f32| {
        let i = x.to_bits() as i32;
        if i < 0 {
            i64::from(i32::MIN) - i64::from(i)
        } else {
            i64::from(i)
        }
    };
    key(a).abs_diff(key(b))
}

/// `t` dequantized on `gpu` and on the CPU, chunk by chunk; `None` when the GPU has no
/// dequantizer for its type.
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
        differing: 0,
        max_ulp: 0,
        first: None,
        bytes: 0,
        kernel_ms: 0.0,
    };
    let mut start = 0;
    while start < t.rows() {
        let end = (start + rows_per_chunk).min(t.rows());
        let src = &bytes[(start * row_bytes) as usize..(end * row_bytes) as usize];
        let n = ((end - start) * row_len) as usize;
        let (on_gpu, ms) = gpu.dequantize(ty, src, n)?;
        check.bytes += src.len() as u64;
        check.kernel_ms += f64::from(ms);
        let mut on_cpu = vec![0f32; n];
        quant::dequantize_rows(ty, src, &mut on_cpu, row_len as usize)?;
        for (i, (g, c)) in on_gpu.iter().zip(&on_cpu).enumerate() {
            if g.to_bits() != c.to_bits() {
                let at = check.values + i as u64;
                check.differing += 1;
                check.max_ulp = check.max_ulp.max(ulp(*g, *c));
                check.first.get_or_insert((at, at / ty.block_size() as u64));
            }
        }
        check.values += n as u64;
        files.release_rows(t, start..end);
        start = end;
    }
    Ok(Some(check))
}

#[cfg(test)]
mod tests {
    use super::ulp;

    #[test]
    fn ulps_count_across_zero() {
        assert_eq!(ulp(1.0, 1.0), 0);
        assert_eq!(ulp(1.0, f32::from_bits(1.0f32.to_bits() + 3)), 3);
        assert_eq!(ulp(0.0, -0.0), 0);
        assert_eq!(ulp(f32::from_bits(1), -f32::from_bits(1)), 2);
    }
}
