//! The K-quants as ggml quantizes them without an importance matrix: `quantize_q*_K` with no
//! weights runs `quantize_row_q*_K_ref`, whose scale fits are `make_qkx2_quants` (Q2_K, Q4_K,
//! Q5_K), `make_q3_quants` (Q3_K) and `make_qx_quants` (Q6_K). Each is reproduced here in f32
//! with ggml's order of operations, so the bytes are ggml's.

use super::block::{abs_and_signed_max, each_block, f16_value, group, nearest_int, put_f16};

/// ggml's `GROUP_MAX_EPS`: groups whose absmax is below it count as all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// `G` groups of `N` values side by side: `v[i][g]` is value `i` of group `g`. The fits below
/// run on all groups at once, lane by lane: each lane does exactly the scalar C function's
/// operations in its order (so its result is ggml's, bit for bit), and the independent lanes
/// let the compiler use SIMD and keep several dependency chains in flight.
type Lanes<T, const G: usize, const N: usize> = [[T; G]; N];

/// The groups of `N` values of a block, side by side (see [`Lanes`]).
#[inline(always)]
fn transpose<const BS: usize, const G: usize, const N: usize>(x: &[f32; BS]) -> Lanes<f32, G, N> {
    std::array::from_fn(|i| std::array::from_fn(|g| x[N * g + i]))
}

/// ggml's `make_qkx2_quants` for `G` groups at once: codes `L` in `0..=nmax` and a scale and
/// offset with `x ≈ scale · L - min`, fitted by weighted least squares over `nstep + 1` trial
/// inverse scales `(rmin + rdelta · is + nmax) / (max - min)`, keeping the trial of least
/// weighted error (sum of absolute errors if `use_mad`, of squares otherwise). A trial that wins
/// moves `min`, which the later trials start from. Returns per group `(scale, min)`; the group
/// minimum is never above zero, so `min` (its negation) is never below.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn make_qkx2<const G: usize, const N: usize>(
    nmax: i32,
    x: &Lanes<f32, G, N>,
    weights: &Lanes<f32, G, N>,
    l: &mut Lanes<u8, G, N>,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> ([f32; G], [f32; G]) {
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x: [f32; G] = std::array::from_fn(|g| sum_w[g] * x[0][g]);
    for i in 1..N {
        for g in 0..G {
            let v = x[i][g];
            min[g] = if v < min[g] { v } else { min[g] };
            max[g] = if v > max[g] { v } else { max[g] };
            let w = weights[i][g];
            sum_w[g] += w;
            sum_x[g] += w * v;
        }
    }
    for m in &mut min {
        *m = if *m > 0.0 { 0.0 } else { *m };
    }
    // ggml returns at once for a group whose max equals its (clamped) min; its lane computes
    // on (with infinite scales) and is overwritten at the end.
    let flat: [bool; G] = std::array::from_fn(|g| max[g] == min[g]);
    let flat_min = min;
    let nmaxf = nmax as f32;
    let mut scale = [0f32; G];
    let mut best_error = [0f32; G];
    let mut iscale: [f32; G] = std::array::from_fn(|g| nmaxf / (max[g] - min[g]));
    for g in 0..G {
        scale[g] = 1.0 / iscale[g];
    }
    for i in 0..N {
        for g in 0..G {
            let q = nearest_int(iscale[g] * (x[i][g] - min[g])).clamp(0, nmax);
            l[i][g] = q as u8;
            let diff = scale[g] * q as f32 + min[g] - x[i][g];
            best_error[g] += weights[i][g] * err(diff);
        }
    }
    if nstep >= 1 {
        let mut laux = [[0f32; G]; N];
        for is in 0..=nstep {
            for g in 0..G {
                iscale[g] = (rmin + rdelta * is as f32 + nmaxf) / (max[g] - min[g]);
            }
            let (mut sum_l, mut sum_l2, mut sum_xl) = ([0f32; G], [0f32; G], [0f32; G]);
            for i in 0..N {
                for g in 0..G {
                    let q = nearest_int(iscale[g] * (x[i][g] - min[g])).clamp(0, nmax) as f32;
                    laux[i][g] = q;
                    let w = weights[i][g];
                    sum_l[g] += w * q;
                    sum_l2[g] += w * q * q;
                    sum_xl[g] += w * q * x[i][g];
                }
            }
            let mut this_scale = [0f32; G];
            let mut this_min = [0f32; G];
            let mut fits = [false; G];
            for g in 0..G {
                let d = sum_w[g] * sum_l2[g] - sum_l[g] * sum_l[g];
                let s = (sum_w[g] * sum_xl[g] - sum_x[g] * sum_l[g]) / d;
                let m = (sum_l2[g] * sum_x[g] - sum_l[g] * sum_xl[g]) / d;
                let above = m > 0.0;
                this_scale[g] = if above { sum_xl[g] / sum_l2[g] } else { s };
                this_min[g] = if above { 0.0 } else { m };
                fits[g] = d > 0.0;
            }
            let mut cur_error = [0f32; G];
            for i in 0..N {
                for g in 0..G {
                    let diff = this_scale[g] * laux[i][g] + this_min[g] - x[i][g];
                    cur_error[g] += weights[i][g] * err(diff);
                }
            }
            let take: [bool; G] = std::array::from_fn(|g| fits[g] && cur_error[g] < best_error[g]);
            if take.iter().any(|&t| t) {
                for i in 0..N {
                    for g in 0..G {
                        l[i][g] = if take[g] { laux[i][g] as u8 } else { l[i][g] };
                    }
                }
                for g in 0..G {
                    if take[g] {
                        best_error[g] = cur_error[g];
                        scale[g] = this_scale[g];
                        min[g] = this_min[g];
                    }
                }
            }
        }
    }
    let mut neg_min = [0f32; G];
    for g in 0..G {
        if flat[g] {
            scale[g] = 0.0;
            min[g] = flat_min[g];
            for row in l.iter_mut() {
                row[g] = 0;
            }
        }
        neg_min[g] = -min[g];
    }
    (scale, neg_min)
}

/// ggml's `make_q3_quants` with `do_rmse`: codes in `-nmax..nmax` (returned offset by `nmax`)
/// from the signed extreme, then up to five rounds of moving single codes where that raises
/// the x²-weighted fit `(Σ w·x·l)² / Σ w·l²`. Returns the fitted scale.
#[inline(always)]
fn make_q3(nmax: i32, x: &[f32; 16], out: &mut [u8]) -> f32 {
    let (amax, max) = abs_and_signed_max(x);
    if amax < GROUP_MAX_EPS {
        out[..16].fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut l = [0i32; 16];
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..16 {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = q;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..16 {
            let w = x[i] * x[i];
            let li = l[i] as f32;
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != l[i] {
                    let nl = new_l as f32;
                    slx += w * x[i] * nl;
                    sl2 += w * nl * nl;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (o, q) in out[..16].iter_mut().zip(l) {
        *o = (q + nmax) as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// The inverse scales `make_qx_quants` tries: its first, then `is` in -9..=9 but 0.
const QX_TRIALS: usize = 19;

/// ggml's `make_qx_quants` with `rmse_type` 1 and no weights (as `quantize_row_q6_K_ref` calls
/// it): codes in `-nmax..nmax` (returned offset by `nmax`) for the best of 19 trial inverse
/// scales (`-nmax / max`, then `-(nmax + 0.1 · is) / max`) by the x²-weighted fit. Returns the
/// fitted scale. The trials' sums do not depend on one another, so they run side by side, each
/// in ggml's order; the choice among them goes in ggml's order of trials, and the codes are
/// those of the last trial chosen, as ggml's rewrites leave them.
#[inline(always)]
fn make_qx(nmax: i32, x: &[f32; 16], out: &mut [u8]) -> f32 {
    let out = &mut out[..16];
    let (amax, max) = abs_and_signed_max(x);
    if amax < GROUP_MAX_EPS {
        out.fill(0);
        return 0.0;
    }
    let nmaxf = nmax as f32;
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscales = [0f32; QX_TRIALS];
    iscales[0] = -nmaxf / max;
    for (t, iscale) in iscales.iter_mut().enumerate().skip(1) {
        let is = if t <= 9 { t as i32 - 10 } else { t as i32 - 9 };
        *iscale = -(nmaxf + 0.1 * is as f32) / max;
    }
    let (mut sumlx, mut suml2) = ([0f32; QX_TRIALS], [0f32; QX_TRIALS]);
    for &v in x {
        let w = v * v;
        for t in 0..QX_TRIALS {
            let q = code(iscales[t], v) as f32;
            sumlx[t] += w * v * q;
            suml2[t] += w * q * q;
        }
    }
    let mut scale = if suml2[0] != 0.0 {
        sumlx[0] / suml2[0]
    } else {
        0.0
    };
    let mut best = scale * sumlx[0];
    let mut chosen = 0;
    for t in 1..QX_TRIALS {
        if suml2[t] > 0.0 && sumlx[t] * sumlx[t] > best * suml2[t] {
            scale = sumlx[t] / suml2[t];
            best = scale * sumlx[t];
            chosen = t;
        }
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = (nmax + code(iscales[chosen], v)) as u8;
    }
    scale
}

/// Q2_K (`quantize_row_q2_K_ref`): sixteen groups of 16, each fitted by `make_qkx2_quants`
/// (3, weights |x|, rmin -0.5, rdelta 0.1, 15 steps, absolute error); the group scales and
/// minima as 4-bit multiples of the largest over 15, then the codes requantized against the
/// stored scales.
pub(super) fn q2_k(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 84]| {
        let xt: Lanes<f32, 16, 16> = transpose(x);
        let weights = xt.map(|row| row.map(f32::abs));
        let mut lt = [[0u8; 16]; 16];
        let (scales, mins) = make_qkx2(3, &xt, &weights, &mut lt, -0.5, 0.1, 15, true);
        let (max_scale, max_min) = largest(&scales, &mins);
        let mut l: [u8; 256] = std::array::from_fn(|k| lt[k % 16][k / 16]);
        let (sc, rest) = b.split_at_mut(16);
        let (qs, dm) = rest.split_at_mut(64);
        let d = if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for (s, &v) in sc.iter_mut().zip(&scales) {
                *s = nearest_int(iscale * v) as u8;
            }
            put_f16(dm, 0, max_scale / 15.0)
        } else {
            sc.fill(0);
            put_f16(dm, 0, 0.0)
        };
        let dmin = if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for (s, &v) in sc.iter_mut().zip(&mins) {
                *s |= (nearest_int(iscale * v) << 4) as u8;
            }
            put_f16(dm, 2, max_min / 15.0)
        } else {
            put_f16(dm, 2, 0.0)
        };
        let (d, dmin) = (f16_value(d), f16_value(dmin));
        for j in 0..16 {
            let dl = d * f32::from(sc[j] & 0x0f);
            if dl == 0.0 {
                continue;
            }
            let ml = dmin * f32::from(sc[j] >> 4);
            for (o, &v) in l[16 * j..16 * (j + 1)]
                .iter_mut()
                .zip(group::<256, 16>(x, j))
            {
                *o = nearest_int((v + ml) / dl).clamp(0, 3) as u8;
            }
        }
        pack_2bit(&l, qs);
    });
}

/// ggml's 2-bit layout of 256 codes: in each half of 128, byte `l` of its 32 holds codes
/// `l`, `l + 32`, `l + 64` and `l + 96` from the low bits up.
#[inline(always)]
fn pack_2bit(l: &[u8; 256], qs: &mut [u8]) {
    for (half, out) in l.chunks_exact(128).zip(qs.chunks_exact_mut(32)) {
        for (k, o) in out.iter_mut().enumerate() {
            *o = half[k] | (half[k + 32] << 2) | (half[k + 64] << 4) | (half[k + 96] << 6);
        }
    }
}

/// Q3_K (`quantize_row_q3_K_ref`): sixteen groups of 16 fitted by `make_q3_quants` (codes
/// -4..3), 6-bit signed group scales against the scale of largest magnitude over -32, then the
/// codes requantized against the stored scales; code bit 2 goes to `hmask`.
pub(super) fn q3_k(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 110]| {
        let mut l = [0u8; 256];
        let mut scales = [0f32; 16];
        let (mut amax, mut max_scale) = (0f32, 0f32);
        for j in 0..16 {
            scales[j] = make_q3(4, group(x, j), &mut l[16 * j..]);
            let scale = scales[j].abs();
            if scale > amax {
                amax = scale;
                max_scale = scales[j];
            }
        }
        let (hmask, rest) = b.split_at_mut(32);
        let (qs, rest) = rest.split_at_mut(64);
        let (sc, dbytes) = rest.split_at_mut(12);
        sc.fill(0);
        let d = if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &s) in scales.iter().enumerate() {
                let q = i32::from(nearest_int(iscale * s) as i8).clamp(-32, 31) + 32;
                if j < 8 {
                    sc[j] = (q & 0x0f) as u8;
                } else {
                    sc[j - 8] |= ((q & 0x0f) << 4) as u8;
                }
                sc[j % 4 + 8] |= ((q >> 4) << (2 * (j / 4))) as u8;
            }
            put_f16(dbytes, 0, 1.0 / iscale)
        } else {
            put_f16(dbytes, 0, 0.0)
        };
        let d = f16_value(d);
        for j in 0..16 {
            let low = if j < 8 { sc[j] & 0x0f } else { sc[j - 8] >> 4 };
            let high = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
            let s = i32::from(low | (high << 4)) - 32;
            let dl = d * s as f32;
            if dl == 0.0 {
                continue;
            }
            for (o, &v) in l[16 * j..16 * (j + 1)]
                .iter_mut()
                .zip(group::<256, 16>(x, j))
            {
                *o = (nearest_int(v / dl).clamp(-4, 3) + 4) as u8;
            }
        }
        hmask.fill(0);
        for (j, q) in l.iter_mut().enumerate() {
            if *q > 3 {
                hmask[j % 32] |= 1 << (j / 32);
                *q -= 4;
            }
        }
        pack_2bit(&l, qs);
    });
}

/// The weights `quantize_row_q4_K_ref` and `quantize_row_q5_K_ref` give `make_qkx2_quants`:
/// the group's RMS plus each value's magnitude.
#[inline(always)]
fn rms_plus_abs(xt: &Lanes<f32, 8, 32>) -> Lanes<f32, 8, 32> {
    let mut sum_x2 = [0f32; 8];
    for row in xt {
        for (s, &v) in sum_x2.iter_mut().zip(row) {
            *s += v * v;
        }
    }
    let av_x = sum_x2.map(|s| (s / 32.0).sqrt());
    xt.map(|row| std::array::from_fn(|g| av_x[g] + row[g].abs()))
}

/// What Q4_K and Q5_K share: eight groups of 32 fitted by `make_qkx2_quants` (`nmax`, RMS plus
/// |x| weights, squared error), 6-bit scales and minima against the largest over 63 packed in
/// 12 bytes, `d` and `dmin` at bytes 0 and 2, then the codes requantized against the stored
/// scales. Returns the codes.
/// The largest scale and the largest min of a block's groups, from 0 (ggml's `>` scan).
#[inline(always)]
fn largest(scales: &[f32], mins: &[f32]) -> (f32, f32) {
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for (&scale, &min) in scales.iter().zip(mins) {
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    (max_scale, max_min)
}

#[inline(always)]
fn scale_min_k4(x: &[f32; 256], b: &mut [u8], nmax: i32, rmin: f32, nstep: i32) -> [u8; 256] {
    let xt: Lanes<f32, 8, 32> = transpose(x);
    let weights = rms_plus_abs(&xt);
    let mut lt = [[0u8; 8]; 32];
    let (scales, mins) = make_qkx2(nmax, &xt, &weights, &mut lt, rmin, 0.1, nstep, false);
    let (max_scale, max_min) = largest(&scales, &mins);
    let mut l: [u8; 256] = std::array::from_fn(|k| lt[k % 32][k / 32]);
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut b[4..16];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16_value(put_f16(b, 0, max_scale / 63.0));
    let dmin = f16_value(put_f16(b, 2, max_min / 63.0));
    let sc = &b[4..16];
    for j in 0..8 {
        // ggml's get_scale_min_k4.
        let (s, m) = if j < 4 {
            (sc[j] & 63, sc[j + 4] & 63)
        } else {
            (
                (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4),
                (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
            )
        };
        let dl = d * f32::from(s);
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * f32::from(m);
        for (o, &v) in l[32 * j..32 * (j + 1)]
            .iter_mut()
            .zip(group::<256, 32>(x, j))
        {
            *o = nearest_int((v + ml) / dl).clamp(0, nmax) as u8;
        }
    }
    l
}

/// Q4_K (`quantize_row_q4_K_ref`): `make_qkx2_quants(32, 15, …, -1, 0.1, 20)` per group; codes
/// `l` and `l + 32` of each 64 share a byte.
pub(super) fn q4_k(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 144]| {
        let l = scale_min_k4(x, b, 15, -1.0, 20);
        for (codes, out) in l.chunks_exact(64).zip(b[16..].chunks_exact_mut(32)) {
            for (k, o) in out.iter_mut().enumerate() {
                *o = codes[k] | (codes[k + 32] << 4);
            }
        }
    });
}

/// Q5_K (`quantize_row_q5_K_ref`): `make_qkx2_quants(32, 31, …, -0.5, 0.1, 15)` per group; the
/// low nibbles as Q4_K's, the fifth bits of each 64 in two bits of `qh` per pair.
pub(super) fn q5_k(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 176]| {
        let l = scale_min_k4(x, b, 31, -0.5, 15);
        let (qh, ql) = b[16..].split_at_mut(32);
        qh.fill(0);
        for (n, (codes, out)) in l.chunks_exact(64).zip(ql.chunks_exact_mut(32)).enumerate() {
            let (m1, m2) = (1u8 << (2 * n), 2u8 << (2 * n));
            for (k, o) in out.iter_mut().enumerate() {
                let (mut l1, mut l2) = (codes[k], codes[k + 32]);
                if l1 > 15 {
                    l1 -= 16;
                    qh[k] |= m1;
                }
                if l2 > 15 {
                    l2 -= 16;
                    qh[k] |= m2;
                }
                *o = l1 | (l2 << 4);
            }
        }
    });
}

/// Q6_K (`quantize_row_q6_K_ref`): sixteen groups of 16 fitted by `make_qx_quants` (codes
/// -32..31, x² weights), 8-bit signed group scales against the scale of largest magnitude over
/// -128, then the codes requantized against the stored scales; a block whose scales are all
/// (near) zero is all zero bytes.
pub(super) fn q6_k(src: &[f32], dst: &mut [u8]) {
    each_block(src, dst, |x: &[f32; 256], b: &mut [u8; 210]| {
        let mut l = [0u8; 256];
        let mut scales = [0f32; 16];
        let (mut max_abs_scale, mut max_scale) = (0f32, 0f32);
        for j in 0..16 {
            let scale = make_qx(32, group(x, j), &mut l[16 * j..]);
            scales[j] = scale;
            if scale.abs() > max_abs_scale {
                max_abs_scale = scale.abs();
                max_scale = scale;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            b.fill(0);
            return;
        }
        let (ql, rest) = b.split_at_mut(128);
        let (qh, rest) = rest.split_at_mut(64);
        let (sc, dbytes) = rest.split_at_mut(16);
        let iscale = -128.0 / max_scale;
        let d = f16_value(put_f16(dbytes, 0, 1.0 / iscale));
        for (s, &v) in sc.iter_mut().zip(&scales) {
            *s = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for j in 0..16 {
            let dl = d * f32::from(sc[j] as i8);
            if dl == 0.0 {
                continue;
            }
            for (o, &v) in l[16 * j..16 * (j + 1)]
                .iter_mut()
                .zip(group::<256, 16>(x, j))
            {
                *o = (nearest_int(v / dl).clamp(-32, 31) + 32) as u8;
            }
        }
        for ((codes, ql), qh) in l
            .chunks_exact(128)
            .zip(ql.chunks_exact_mut(64))
            .zip(qh.chunks_exact_mut(32))
        {
            for k in 0..32 {
                let q = [codes[k], codes[k + 32], codes[k + 64], codes[k + 96]];
                ql[k] = (q[0] & 0x0f) | ((q[2] & 0x0f) << 4);
                ql[k + 32] = (q[1] & 0x0f) | ((q[3] & 0x0f) << 4);
                qh[k] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
            }
        }
    });
}
