//! The i-quants: 256-element super-blocks with an f16 `d`, per-sub-block 4-bit scales, and
//! codes that index lattice grids (IQ1/IQ2/IQ3) or a non-linear codebook (IQ4). Sign and
//! delta factors are applied in gguf-py's order: `(db * grid) * ±1` and `dl * (grid ± delta)`.

use super::block::{codebook_nibbles, f16_at, f16_to_f32, nibble, u16_at, u32_at};
use super::grids::{
    IQ1S_GRID, IQ1_DELTA, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, IQ4NL_VALUES,
    KSIGNS,
};

/// The sub-block scale of IQ2 and IQ3_XXS: `(d * (0.5 + s)) * unit`, rounded at each step.
#[inline(always)]
fn half_step_scale(d: f32, s: u32, unit: f32) -> f32 {
    d * (0.5 + s as f32) * unit
}

/// ±1 for each bit of a sign byte (a set bit negates): a group's signs become two vector loads
/// instead of bit twiddling, which measured 2x faster on IQ2_XXS.
static SIGN_FACTORS: [[f32; 8]; 256] = {
    let mut table = [[1.0; 8]; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut bit = 0;
        while bit < 8 {
            if (byte >> bit) & 1 == 1 {
                table[byte][bit] = -1.0;
            }
            bit += 1;
        }
        byte += 1;
    }
    table
};

/// The sign factors of group `k` of an IQ2_XXS/IQ3_XXS aux word, whose low 28 bits are four
/// 7-bit indices into [`KSIGNS`].
#[inline(always)]
fn aux_signs(aux: u32, k: usize) -> &'static [f32; 8] {
    &SIGN_FACTORS[usize::from(KSIGNS[(aux >> (7 * k)) as usize & 0x7f])]
}

/// One grid row times `db`, then times its ±1 sign factor.
#[inline(always)]
fn signed_row<const W: usize>(db: f32, row: &[u8; W], signs: &[f32], out: &mut [f32]) {
    for ((o, &g), &s) in out.iter_mut().zip(row).zip(signs) {
        *o = db * f32::from(g) * s;
    }
}

/// Two grid rows of four and the eight sign factors that cover them.
#[inline(always)]
fn signed_row_pair(db: f32, rows: [&[u8; 4]; 2], signs: &[f32; 8], out: &mut [f32]) {
    let (lo, hi) = out.split_at_mut(4);
    signed_row(db, rows[0], &signs[..4], lo);
    signed_row(db, rows[1], &signs[4..], hi);
}

/// IQ2_XXS: `d`, then per 32 elements 4 grid indices and an aux word holding the 4 sign
/// indices and the scale.
#[inline(always)]
pub(super) fn iq2_xxs(b: &[u8; 66], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    for (o, q) in out.chunks_exact_mut(32).zip(b[2..].chunks_exact(8)) {
        let aux = u32_at(q, 4);
        let db = half_step_scale(d, aux >> 28, 0.25);
        for (k, o) in o.chunks_exact_mut(8).enumerate() {
            signed_row(db, &IQ2XXS_GRID[usize::from(q[k])], aux_signs(aux, k), o);
        }
    }
}

/// IQ2_XS: `d`, 32 u16 codes (9-bit grid index, 7-bit sign index), then 16 4-bit scales.
#[inline(always)]
pub(super) fn iq2_xs(b: &[u8; 74], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    for (g, o) in out.chunks_exact_mut(8).enumerate() {
        let db = half_step_scale(d, u32::from(nibble(&b[66..74], g / 2)), 0.25);
        let q = u16_at(b, 2 + 2 * g);
        let signs = &SIGN_FACTORS[usize::from(KSIGNS[usize::from(q >> 9)])];
        signed_row(db, &IQ2XS_GRID[usize::from(q & 0x1ff)], signs, o);
    }
}

/// IQ2_S: `d`, 32 low bytes of grid indices, 32 sign bytes, 8 bytes of 2-bit index tops,
/// then 16 4-bit scales.
#[inline(always)]
pub(super) fn iq2_s(b: &[u8; 82], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    for (g, o) in out.chunks_exact_mut(8).enumerate() {
        let db = half_step_scale(d, u32::from(nibble(&b[74..82], g / 2)), 0.25);
        let top = usize::from(b[66 + g / 4] >> (2 * (g % 4))) & 3;
        let index = usize::from(b[2 + g]) | top << 8;
        signed_row(
            db,
            &IQ2S_GRID[index],
            &SIGN_FACTORS[usize::from(b[34 + g])],
            o,
        );
    }
}

/// IQ3_XXS: `d`, 64 grid indices (rows of 4), then per 32 elements an aux word with the 4 sign
/// indices and the scale.
#[inline(always)]
pub(super) fn iq3_xxs(b: &[u8; 98], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    for (j, (o, q)) in out
        .chunks_exact_mut(32)
        .zip(b[2..66].chunks_exact(8))
        .enumerate()
    {
        let aux = u32_at(b, 66 + 4 * j);
        let db = half_step_scale(d, aux >> 28, 0.5);
        for (k, (o, q)) in o.chunks_exact_mut(8).zip(q.chunks_exact(2)).enumerate() {
            let rows = [
                &IQ3XXS_GRID[usize::from(q[0])],
                &IQ3XXS_GRID[usize::from(q[1])],
            ];
            signed_row_pair(db, rows, aux_signs(aux, k), o);
        }
    }
}

/// IQ3_S: `d`, 64 low bytes of grid indices (rows of 4), 8 bytes of their ninth bits, 32 sign
/// bytes, then 8 4-bit scales; a sub-block's scale is `d * (1 + 2s)`.
#[inline(always)]
pub(super) fn iq3_s(b: &[u8; 110], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let index = |i: usize| usize::from(b[2 + i]) | usize::from((b[66 + i / 8] >> (i % 8)) & 1) << 8;
    for (g, o) in out.chunks_exact_mut(8).enumerate() {
        let db = d * f32::from(1 + 2 * nibble(&b[106..110], g / 4));
        let rows = [&IQ3S_GRID[index(2 * g)], &IQ3S_GRID[index(2 * g + 1)]];
        signed_row_pair(db, rows, &SIGN_FACTORS[usize::from(b[74 + g])], o);
    }
}

/// One IQ1 grid row: `dl * (g + delta)`.
#[inline(always)]
fn iq1_row(dl: f32, row: &[i8; 8], delta: f32, out: &mut [f32]) {
    for (o, &g) in out.iter_mut().zip(row) {
        *o = dl * (f32::from(g) + delta);
    }
}

/// The IQ1 delta, negated when its bit is set.
#[inline(always)]
fn iq1_delta(negative: bool) -> f32 {
    if negative {
        -IQ1_DELTA
    } else {
        IQ1_DELTA
    }
}

/// IQ1_S: `d`, 32 low bytes of grid indices, then per 32 elements a u16 holding four 3-bit
/// index tops, a 3-bit scale (`d * (2s + 1)`) and the delta's sign.
#[inline(always)]
pub(super) fn iq1_s(b: &[u8; 50], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    for (j, (o, q)) in out
        .chunks_exact_mut(32)
        .zip(b[2..34].chunks_exact(4))
        .enumerate()
    {
        let qh = u16_at(b, 34 + 2 * j);
        let dl = d * f32::from(2 * ((qh >> 12) & 7) + 1);
        let delta = iq1_delta(qh & 0x8000 != 0);
        for (k, (o, &q)) in o.chunks_exact_mut(8).zip(q).enumerate() {
            let index = usize::from(q) | usize::from((qh >> (3 * k)) & 7) << 8;
            iq1_row(dl, &IQ1S_GRID[index], delta, o);
        }
    }
}

/// IQ1_M: 32 low bytes of grid indices, 32 nibbles of 3-bit index top and delta sign, then four
/// u16 that hold sixteen 3-bit scales (`d * (2s + 1)`, one per 16 elements) in their low 12 bits
/// and the f16 `d` in their top nibbles.
#[inline(always)]
pub(super) fn iq1_m(b: &[u8; 56], out: &mut [f32; 256]) {
    let s: [u16; 4] = std::array::from_fn(|i| u16_at(b, 48 + 2 * i));
    let d = f16_to_f32((s[0] >> 12) | (s[1] >> 12) << 4 | (s[2] >> 12) << 8 | (s[3] >> 12) << 12);
    for (g, o) in out.chunks_exact_mut(8).enumerate() {
        let sub = g / 2;
        let dl = d * f32::from(2 * ((s[sub / 4] >> (3 * (sub % 4))) & 7) + 1);
        let top = nibble(&b[32..48], g);
        let index = usize::from(b[g]) | usize::from(top & 7) << 8;
        iq1_row(dl, &IQ1S_GRID[index], iq1_delta(top & 8 != 0), o);
    }
}

/// IQ4_NL: `d`, then 16 bytes of codebook nibbles.
#[inline(always)]
pub(super) fn iq4_nl(b: &[u8; 18], out: &mut [f32; 32]) {
    codebook_nibbles(f16_at(b, 0), &IQ4NL_VALUES, &b[2..], out);
}

/// IQ4_XS: `d`, a u16 of 2-bit scale tops, 4 bytes of 4-bit scale lows, then per 32 elements
/// 16 bytes of codebook nibbles; scales are 6-bit minus 32.
#[inline(always)]
pub(super) fn iq4_xs(b: &[u8; 136], out: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let tops = u16_at(b, 2);
    for (j, (o, q)) in out
        .chunks_exact_mut(32)
        .zip(b[8..].chunks_exact(16))
        .enumerate()
    {
        let top = ((tops >> (2 * j)) & 3) as u8;
        let ls = (nibble(&b[4..8], j) | top << 4) as i8 - 32;
        codebook_nibbles(d * f32::from(ls), &IQ4NL_VALUES, q, o);
    }
}
