//! IQ4_NL and IQ4_XS: each group of 32 values as 4-bit indices into the 16 non-linear levels
//! that the dequantizer reads, with a scale found by a small least-squares search of our own.

use super::block::{each_block, inverse, pack_nibbles, put_f16, signed_absmax, through_f16};
use crate::weights::quant::grids::IQ4NL_VALUES;

/// The 16 levels as f32, ascending, and the 15 midpoints between neighbours: the nearest level
/// to `y` is the number of midpoints below it.
struct Codebook {
    levels: [f32; 16],
    mids: [f32; 15],
}

impl Codebook {
    fn new() -> Self {
        let levels = IQ4NL_VALUES.map(f32::from);
        let mids = std::array::from_fn(|k| 0.5 * (levels[k] + levels[k + 1]));
        Codebook { levels, mids }
    }

    #[inline(always)]
    fn nearest(&self, y: f32) -> u8 {
        self.mids.iter().map(|&m| u8::from(y > m)).sum()
    }

    /// The nearest level's index for each value at scale `d` (index 8, the level nearest zero,
    /// where `d` is 0).
    #[inline(always)]
    fn indices(&self, x: &[f32; 32], d: f32) -> [u8; 32] {
        let id = inverse(d);
        x.map(|v| self.nearest(v * id))
    }

    /// The scale that best fits `x`: for candidate inverse scales that send the extreme value to
    /// levels near the codebook's longer (negative) end, take the nearest indices, fit the scale
    /// to them by least squares, and keep the fit with the least squared error (the largest
    /// `(Σ x·l)² / Σ l²`). Searching a few candidates is what lifts a 4-bit codebook from naive
    /// absmax scaling's error to the type's usual error.
    fn best_scale(&self, x: &[f32; 32]) -> f32 {
        let max = signed_absmax(x);
        if max == 0.0 {
            return 0.0;
        }
        let (mut best_d, mut best_score) = (0.0f32, -1.0f32);
        for step in -8i8..=8 {
            let id = (self.levels[0] + f32::from(step)) / max;
            let (mut sxl, mut sll) = (0.0f32, 0.0f32);
            for &v in x {
                let l = self.levels[usize::from(self.nearest(v * id))];
                sxl += v * l;
                sll += l * l;
            }
            let score = sxl * sxl / sll;
            if score > best_score {
                (best_d, best_score) = (sxl / sll, score);
            }
        }
        best_d
    }
}

/// IQ4_NL: the best scale as f16, then 32 nearest-level indices at that stored scale.
pub(super) fn iq4_nl(src: &[f32], dst: &mut [u8]) {
    let book = Codebook::new();
    each_block(src, dst, |x: &[f32; 32], b: &mut [u8; 18]| {
        let d = through_f16(book.best_scale(x));
        put_f16(b, 0, d);
        pack_nibbles(&book.indices(x, d), &mut b[2..]);
    });
}

/// IQ4_XS: eight groups of 32 with 6-bit signed group scales `ls - 32` times a super-block `d`
/// chosen so that the largest group scale maps to -32 exactly.
pub(super) fn iq4_xs(src: &[f32], dst: &mut [u8]) {
    let book = Codebook::new();
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 136]| {
        let groups: &[[f32; 32]; 8] = bytemuck::cast_ref(x);
        let scales = groups.each_ref().map(|g| book.best_scale(g));
        let d = through_f16(signed_absmax(&scales) / -32.0);
        let id = inverse(d);
        let mut tops = 0u16;
        b[4..8].fill(0);
        for (j, g) in groups.iter().enumerate() {
            let ls = (scales[j] * id).round().clamp(-32.0, 31.0) as i8;
            let code = (ls + 32) as u8;
            b[4 + j / 2] |= (code & 0x0f) << (4 * (j % 2));
            tops |= u16::from(code >> 4) << (2 * j);
            let q = book.indices(g, d * f32::from(ls));
            pack_nibbles(&q, &mut b[8 + 16 * j..]);
        }
        put_f16(b, 0, d);
        b[2..4].copy_from_slice(&tops.to_le_bytes());
    });
}
