//! GLM-5-FP8's Hugging Face layout for `synth --quant fp8`: the linear weights as FP8 E4M3, each
//! 128×128 block scaled by its own float32 `weight_scale_inv` (block absmax / 448, the largest
//! E4M3 value; the stored element is the weight divided by that scale, rounded to nearest even),
//! as DeepSeek's and Z.ai's converters write them. Left in BF16, as in GLM-5-FP8: embeddings,
//! `lm_head`, norms, the router (`mlp.gate`), the indexer's `weights_proj` and the MTP layer's
//! `eh_proj`.

use crate::weights::fp8::DEFAULT_BLOCK;

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

/// A row-major `rows`×`cols` weight as (each value divided by its block's scale, the scales):
/// the first is what the FP8 tensor stores once rounded to E4M3.
pub fn block_scaled(values: &[f32], rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
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
    scales
        .iter_mut()
        .for_each(|s| *s = if *s > 0.0 { *s / E4M3_MAX } else { 1.0 });
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
