//! Encoders from f32 to the GGML types the demo model uses.

use half::f16;

use crate::weights::GgmlType;

/// Encode `values` (a whole number of blocks) as `ty`.
///
/// Panics for types without an encoder here: the caller picks the types.
pub fn encode(ty: GgmlType, values: &[f32]) -> Vec<u8> {
    match ty {
        GgmlType::F32 => bytemuck::cast_slice(values).to_vec(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => values.chunks_exact(32).flat_map(q8_0_block).collect(),
        other => panic!("no encoder for {other}"),
    }
}

/// ggml's Q8_0: scale d = absmax/127 as f16, then 32 signed bytes round(x/d).
fn q8_0_block(xs: &[f32]) -> Vec<u8> {
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    out.extend(xs.iter().map(|&x| (x * id).round() as i8 as u8));
    out
}
