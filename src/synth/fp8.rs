//! GLM-5-FP8's Hugging Face layout for `synth --quant fp8`: the linear weights as FP8 E4M3, each
//! 128×128 block scaled by its own float32 `weight_scale_inv` (block absmax / 448, the largest
//! E4M3 value; the stored element is the weight divided by that scale, rounded to nearest even),
//! as DeepSeek's and Z.ai's converters write them. Left in BF16, as in GLM-5-FP8: embeddings,
//! `lm_head`, norms, the router (`mlp.gate`), the indexer's `weights_proj` and the MTP layer's
//! `eh_proj`. DeepSeek-V3.1's layout (`--quant fp8-ue8m0`) rounds each scale up to a power of
//! two, as DeepGEMM's UE8M0 cast does, and divides the weight by that.

use crate::weights::fp8::{ScaleFmt, DEFAULT_BLOCK};

/// The block edge, as `quantization_config.weight_block_size` gives it.
pub const BLOCK: usize = DEFAULT_BLOCK;

/// The largest finite FP8 E4M3 value.
const E4M3_MAX: f32 = 448.0;

/// Whether the checkpoint tensor `name` of `shape` is stored as FP8 with block scales.
pub fn is_fp8_weight(name: &str, shape: &[u64]) -> bool {
    const BF16: [&str; 7] = [
        "embed_tokens",
        "lm_head",
        "norm",
        "mlp.gate.",
        "weights_proj",
        "eh_proj",
        "shared_head",
    ];
    shape.len() == 2 && name.ends_with(".weight") && !BF16.iter().any(|k| name.contains(k))
}

/// The shape of a `rows`×`cols` weight's scales.
pub fn scale_shape(rows: u64, cols: u64) -> Vec<u64> {
    let b = BLOCK as u64;
    vec![rows.div_ceil(b), cols.div_ceil(b)]
}

/// A row-major `rows`×`cols` weight as (each value divided by its block's scale, the scales in
/// format `fmt`): the first is what the FP8 tensor stores once rounded to E4M3.
pub fn block_scaled(
    values: &[f32],
    rows: usize,
    cols: usize,
    fmt: ScaleFmt,
) -> (Vec<f32>, Vec<f32>) {
    let b = BLOCK;
    let (block_rows, block_cols) = (rows.div_ceil(b), cols.div_ceil(b));
    let mut scales = vec![0f32; block_rows * block_cols];
    for (r, row) in values.chunks(cols).enumerate() {
        for (c, v) in row.iter().enumerate() {
            let s = &mut scales[(r / b) * block_cols + c / b];
            *s = s.max(v.abs());
        }
    }
    // An all-zero block keeps scale 1: its elements are 0 either way.
    scales.iter_mut().for_each(|s| {
        *s = match (*s > 0.0, fmt) {
            (false, _) => 1.0,
            (true, ScaleFmt::Float) => *s / E4M3_MAX,
            (true, ScaleFmt::Ue8m0) => ceil_pow2(*s / E4M3_MAX),
        }
    });
    let scaled = values
        .chunks(cols)
        .enumerate()
        .flat_map(|(r, row)| {
            let scales = &scales;
            row.iter()
                .enumerate()
                .map(move |(c, v)| v / scales[(r / b) * block_cols + c / b])
        })
        .collect();
    (scaled, scales)
}

/// The smallest power of two at or above a positive finite `s` (at least 2^−126, a UE8M0
/// value): rounding up keeps every scaled value within E4M3's 448.
fn ceil_pow2(s: f32) -> f32 {
    const MANTISSA: u32 = 0x007f_ffff;
    // A mantissa that is not zero carries into the exponent; zero stays as it is.
    f32::from_bits((s.max(f32::MIN_POSITIVE).to_bits() + MANTISSA) & !MANTISSA)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::fp8::is_ue8m0;

    #[test]
    fn ue8m0_scales_are_the_next_power_of_two() {
        for (s, up) in [
            (1.0, 1.0),
            (0.75, 1.0),
            (1.0 + f32::EPSILON, 2.0),
            (3.0e-3, 1.0 / 256.0),
            (2f32.powi(-20), 2f32.powi(-20)),
            (1e-45, f32::MIN_POSITIVE),
        ] {
            assert_eq!(ceil_pow2(s), up, "{s}");
            assert!(is_ue8m0(up), "{up}");
        }
        // A block of absmax 1 gets 1/448 up to 2^-8; its values stay within E4M3's range.
        let block: Vec<f32> = (0..BLOCK * BLOCK)
            .map(|i| 1.0 - i as f32 / 8192.0)
            .collect();
        let (scaled, scales) = block_scaled(&block, BLOCK, BLOCK, ScaleFmt::Ue8m0);
        assert_eq!(scales, [2f32.powi(-8)]);
        assert_eq!(scaled[0], 256.0);
        assert!(scaled.iter().all(|v| v.abs() <= E4M3_MAX));
    }
}
