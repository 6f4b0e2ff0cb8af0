//! FP8 to f32, element by element and for block-scaled weights (GLM-5-FP8, DeepSeek-V3 layout).
//!
//! A block-scaled weight `W` [out, in] of FP8 comes with `W_scale_inv`
//! [ceil(out/B), ceil(in/B)] in f32, bf16 or F8_E8M0; element (r, c) is
//! `f32(W[r][c]) * scale[r/B][c/B]`, one f32 multiply, the same as the reference `weight_dequant`
//! (`x.float() * s` per block).
//!
//! DeepSeek-V3.1 declares `quantization_config.scale_fmt: "ue8m0"` ([`ScaleFmt`]): its scales,
//! stored as f32, must be powers of two ([`is_ue8m0`]), since DeepGEMM's UE8M0 kernels keep only
//! their exponent and would round any other scale silently.

use std::ops::Range;

use rayon::prelude::*;

use super::error::{Result, WeightError};
use super::ggml_type::GgmlType;
use super::safetensors::SafetensorsSet;
use super::tensor::{Encoding, TensorEntry};

/// The block edge of GLM-5-FP8 and DeepSeek-V3 (`weight_block_size` [128, 128]).
pub const DEFAULT_BLOCK: usize = 128;

/// The bit layout of an 8-bit float: 1 sign bit, then exponent, then mantissa.
struct Fp8Format {
    exp_bits: u32,
    man_bits: u32,
    /// IEEE-like: the top exponent holds infinities and NaNs. Otherwise (the "fn" variants)
    /// it holds ordinary numbers and only the all-ones pattern is NaN.
    ieee_specials: bool,
}

/// 2^k as f32, for k in the normal range.
const fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// The f32 value of every byte of a format; every FP8 value is exact in f32.
const fn table(f: Fp8Format) -> [f32; 256] {
    let bias = (1 << (f.exp_bits - 1)) - 1;
    let top_exp = (1 << f.exp_bits) - 1;
    let man_mask = (1 << f.man_bits) - 1;
    let mut out = [0.0; 256];
    let mut byte = 0;
    while byte < 256 {
        let exp = (byte as u32 >> f.man_bits) & top_exp;
        let man = byte as u32 & man_mask;
        let magnitude = if exp == top_exp && f.ieee_specials {
            if man == 0 {
                f32::INFINITY
            } else {
                f32::NAN
            }
        } else if exp == top_exp && man == man_mask {
            f32::NAN
        } else if exp == 0 {
            man as f32 * pow2(1 - bias - f.man_bits as i32)
        } else {
            (man | (man_mask + 1)) as f32 * pow2(exp as i32 - bias - f.man_bits as i32)
        };
        out[byte] = if byte & 0x80 != 0 {
            -magnitude
        } else {
            magnitude
        };
        byte += 1;
    }
    out
}

static E4M3: [f32; 256] = table(Fp8Format {
    exp_bits: 4,
    man_bits: 3,
    ieee_specials: false,
});
static E5M2: [f32; 256] = table(Fp8Format {
    exp_bits: 5,
    man_bits: 2,
    ieee_specials: true,
});

/// An F8_E4M3 ("e4m3fn": bias 7, no infinities, 0x7f and 0xff NaN) byte as f32.
pub fn f8e4m3_to_f32(b: u8) -> f32 {
    E4M3[b as usize]
}

/// An F8_E5M2 (IEEE-like: bias 15, infinities and NaNs) byte as f32.
pub fn f8e5m2_to_f32(b: u8) -> f32 {
    E5M2[b as usize]
}

/// An F8_E8M0 byte as f32: 2^(e−127), exact in f32 (byte 0 is the subnormal 2^−127, as torch
/// converts `float8_e8m0fnu`); 0xff is NaN.
pub fn f8e8m0_to_f32(b: u8) -> f32 {
    match b {
        0 => f32::from_bits(UE8M0_MIN_BITS),
        0xff => f32::NAN,
        e => f32::from_bits(u32::from(e) << 23),
    }
}

/// The bits of 2^−127, the smallest UE8M0 value (an f32 subnormal).
const UE8M0_MIN_BITS: u32 = 1 << 22;

/// Whether `v` is a UE8M0 value, 2^k with −127 ≤ k ≤ 127: positive, finite, no mantissa bit.
pub fn is_ue8m0(v: f32) -> bool {
    let bits = v.to_bits();
    // `bits >> 23` keeps the sign bit, so negative values fall outside 1..=254.
    bits == UE8M0_MIN_BITS || (bits & 0x007f_ffff == 0 && (1..=254).contains(&(bits >> 23)))
}

/// What a checkpoint's `quantization_config.scale_fmt` says its block scales are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleFmt {
    /// No `scale_fmt` (GLM-5-FP8, DeepSeek-V3): any float.
    Float,
    /// `"ue8m0"` (DeepSeek-V3.1): powers of two, whichever dtype stores them.
    Ue8m0,
}

impl ScaleFmt {
    /// The format a parsed `config.json` declares; any other `scale_fmt` is an error naming it,
    /// since glmcheck cannot tell what such scales mean.
    pub fn of_config(config: &serde_json::Value) -> Result<Self, String> {
        let fmt = config
            .get("quantization_config")
            .and_then(|q| q.get("scale_fmt"));
        match fmt {
            None | Some(serde_json::Value::Null) => Ok(ScaleFmt::Float),
            Some(v) if v == "ue8m0" => Ok(ScaleFmt::Ue8m0),
            Some(other) => Err(format!(
                "quantization_config.scale_fmt is {other}; glmcheck knows \"ue8m0\" or none"
            )),
        }
    }
}

/// Dequantize rows `rows` of a block-scaled FP8 weight of `set` into row-major f32.
///
/// Only the bytes of those rows and the scale rows they need are read. `weight` is a 2-D
/// F8_E4M3 or F8_E5M2 tensor, `scale` its f32, bf16 or F8_E8M0 `*_scale_inv` with one value per
/// `block`×`block` tile ([`DEFAULT_BLOCK`] in GLM-5 and DeepSeek-V3 checkpoints).
pub fn dequant_block_scaled(
    set: &SafetensorsSet,
    weight: &TensorEntry,
    scale: &TensorEntry,
    rows: Range<usize>,
    block: usize,
) -> Result<Vec<f32>> {
    let fail = |why: String| WeightError::tensor(set.path(weight), &weight.name, why);
    let table = match weight.encoding {
        Encoding::F8E4M3 => &E4M3,
        Encoding::F8E5M2 => &E5M2,
        ref other => return Err(fail(format!("is {other}, not FP8 E4M3 or E5M2"))),
    };
    let [out_dim, in_dim] = matrix_dims(weight)
        .filter(|&dims| holds(weight, dims, 1))
        .ok_or_else(|| {
            fail(format!(
                "shape {:?} is not a matrix of its {} bytes",
                weight.shape, weight.nbytes
            ))
        })?;
    let (scale_width, decode) = check_scale(scale, [out_dim, in_dim], block).map_err(fail)?;
    if rows.start > rows.end || rows.end > out_dim {
        return Err(fail(format!(
            "rows {rows:?} are outside its {out_dim} rows"
        )));
    }
    if rows.is_empty() || in_dim == 0 {
        return Ok(Vec::new());
    }
    let scale_rows = rows.start / block..rows.end.div_ceil(block);
    let scale_cols = in_dim.div_ceil(block);
    let scale_bytes = &set.bytes(scale)
        [scale_rows.start * scale_cols * scale_width..scale_rows.end * scale_cols * scale_width];
    let scales: Vec<f32> = scale_bytes.chunks_exact(scale_width).map(decode).collect();
    let bytes = &set.bytes(weight)[rows.start * in_dim..rows.end * in_dim];
    let mut out = vec![0.0; rows.len() * in_dim];
    // Tasks of at least 64 Ki elements keep rayon's overhead negligible.
    let min_rows = (1 << 16) / in_dim + 1;
    out.par_chunks_mut(in_dim)
        .zip(bytes.par_chunks(in_dim))
        .enumerate()
        .with_min_len(min_rows)
        .for_each(|(i, (o, w))| {
            let scale_row = (rows.start + i) / block - scale_rows.start;
            let row_scales = &scales[scale_row * scale_cols..][..scale_cols];
            dequant_row(table, w, row_scales, block, o);
        });
    Ok(out)
}

/// One row: each `block`-wide run of elements times its scale.
fn dequant_row(table: &[f32; 256], bytes: &[u8], scales: &[f32], block: usize, out: &mut [f32]) {
    for ((o, w), &s) in out.chunks_mut(block).zip(bytes.chunks(block)).zip(scales) {
        for (o, &b) in o.iter_mut().zip(w) {
            *o = table[b as usize] * s;
        }
    }
}

/// The [rows, columns] of a 2-D tensor whose dimensions fit in memory.
fn matrix_dims(t: &TensorEntry) -> Option<[usize; 2]> {
    match t.shape[..] {
        [r, c] => Some([usize::try_from(r).ok()?, usize::try_from(c).ok()?]),
        _ => None,
    }
}

/// Whether a tensor's bytes are exactly `dims` elements of `width` bytes, so slicing them by
/// row cannot fail.
fn holds(t: &TensorEntry, [rows, cols]: [usize; 2], width: usize) -> bool {
    let bytes = rows.checked_mul(cols).and_then(|n| n.checked_mul(width));
    bytes.is_some_and(|n| n as u64 == t.nbytes)
}

/// A scale element's width in bytes and its decoder.
type ScaleElement = (usize, fn(&[u8]) -> f32);

/// The scale must be f32, bf16 or F8_E8M0 with one value per `block`×`block` tile of a `dims` weight;
/// gives its element width and decoder.
fn check_scale(
    scale: &TensorEntry,
    [rows, cols]: [usize; 2],
    block: usize,
) -> Result<ScaleElement, String> {
    if block == 0 {
        return Err("block size 0".into());
    }
    let element: ScaleElement = match scale.encoding {
        Encoding::Ggml(GgmlType::F32) => (4, |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        Encoding::Ggml(GgmlType::BF16) => (2, |c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        Encoding::F8E8M0 => (1, |c| f8e8m0_to_f32(c[0])),
        ref other => {
            return Err(format!(
                "scale `{}` is {other}, not F32, BF16 or F8_E8M0",
                scale.name
            ))
        }
    };
    let need = [rows.div_ceil(block), cols.div_ceil(block)];
    if matrix_dims(scale) != Some(need) || !holds(scale, need, element.0) {
        return Err(format!(
            "scale `{}` has shape {:?}; a [{rows}, {cols}] weight in {block}×{block} blocks needs {need:?}",
            scale.name, scale.shape
        ));
    }
    Ok(element)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ue8m0_values_are_the_powers_of_two_e8m0_holds() {
        let byte_values: Vec<f32> = (0..255).map(f8e8m0_to_f32).collect();
        assert!(byte_values.iter().all(|&v| is_ue8m0(v)));
        assert_eq!(byte_values[127], 1.0);
        assert_eq!(byte_values[0], 2f32.powi(-126) / 2.0);
        assert!(f8e8m0_to_f32(0xff).is_nan());
        // Below 2^-127 or beyond 2^127 E8M0 has no byte; 0, negatives and specials are none.
        for v in [
            2f32.powi(-126) / 4.0,
            1.5,
            0.0,
            -1.0,
            f32::INFINITY,
            f32::NAN,
        ] {
            assert!(!is_ue8m0(v), "{v}");
        }
    }

    #[test]
    fn scale_fmt_is_read_from_the_quantization_config() {
        let fmt = |q: serde_json::Value| {
            ScaleFmt::of_config(&serde_json::json!({ "quantization_config": q }))
        };
        assert_eq!(
            fmt(serde_json::json!({"scale_fmt": "ue8m0"})),
            Ok(ScaleFmt::Ue8m0)
        );
        assert_eq!(
            fmt(serde_json::json!({"quant_method": "fp8"})),
            Ok(ScaleFmt::Float)
        );
        assert_eq!(
            fmt(serde_json::json!({"scale_fmt": null})),
            Ok(ScaleFmt::Float)
        );
        assert_eq!(
            ScaleFmt::of_config(&serde_json::json!({})),
            Ok(ScaleFmt::Float)
        );
        let err = fmt(serde_json::json!({"scale_fmt": "ue4m3"})).unwrap_err();
        assert!(err.contains("scale_fmt is \"ue4m3\""), "{err}");
    }
}
