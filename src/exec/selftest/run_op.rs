//! One self-test case on a backend and, beside it, in f64 on the CPU: random inputs in the
//! backend's dtype, the op on both, and the outputs to compare.

use crate::dtype::Precision;
use crate::exec::backend::{add_weighted_rows, Backend, Cpu, HeadCut, WeightedRows};
use crate::exec::mat::Mat;
use crate::exec::ops::attention_core::AttentionInputs;
use crate::exec::ops::indexer_core::IndexerInputs;
use crate::exec::ops::rope::{Rope, RotateSpec};
use crate::exec::passes::Passes;
use crate::exec::real::Real;
use crate::rng::SplitMix;
use crate::trace::stats::TensorStats;
use anyhow::Result;

use super::{Op, HEAD_DIMS, THETA};

/// `m`'s rows as a cache holds them after a pass over the rows from `start` on: this pass's rows
/// as an op's output (adding zero), which a GPU may still hold, after the earlier positions as
/// the host's values, or (`earlier_held`) as an op's output too.
fn as_passes<B: Backend<E = f32>>(
    be: &B,
    m: &Mat<f32>,
    start: usize,
    earlier_held: bool,
) -> Result<Vec<Mat<f32>>> {
    let rows = |range: std::ops::Range<usize>| m.gather_rows(&range.collect::<Vec<_>>());
    let held = |x: Mat<f32>| be.add(&x, &Mat::zeros(x.rows, x.cols));
    let this_pass = held(rows(start..m.rows))?;
    Ok(match (start, earlier_held) {
        (0, _) => vec![this_pass],
        (_, false) => vec![rows(0..start), this_pass],
        (_, true) => vec![held(rows(0..start))?, this_pass],
    })
}

/// Attention's inputs from its tensors, keys and `(heads, nope, rope, v, positions)`.
fn attention_inputs<'a, E: Real>(
    (q, kv, k_rope): (&'a Mat<E>, &'a [Mat<E>], &'a [Mat<E>]),
    keys: &'a [Vec<i32>],
    (heads, nope, rope, v, positions): (usize, usize, usize, usize, usize),
    scale: E,
) -> AttentionInputs<'a, E> {
    AttentionInputs {
        q,
        kv: Passes(kv),
        k_rope: Passes(k_rope),
        keys,
        heads,
        nope,
        rope,
        v,
        positions,
        scale,
    }
}

/// `n` random values, roughly normal, held in `dtype`.
fn values(rng: &mut SplitMix, n: usize, scale: f32, dtype: Precision) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.normal() * scale).round_to(dtype))
        .collect()
}

/// The f32 halfway between `x` rounded to `p` and the next value of `p` above it: where
/// rounding to nearest must break the tie to even.
fn halfway_above(x: f32, p: Precision) -> f32 {
    let (low, high) = match p {
        Precision::Bf16 => {
            let b = half::bf16::from_f32(x);
            (b.to_f32(), half::bf16::from_bits(b.to_bits() + 1).to_f32())
        }
        Precision::F16 => {
            let h = half::f16::from_f32(x);
            (h.to_f32(), half::f16::from_bits(h.to_bits() + 1).to_f32())
        }
        Precision::F32 | Precision::F64 => return x,
    };
    low + (high - low) / 2.0
}

fn mat(rng: &mut SplitMix, rows: usize, cols: usize, scale: f32, dtype: Precision) -> Mat<f32> {
    Mat::new(rows, cols, values(rng, rows * cols, scale, dtype))
}

/// `op` on the backend and in f64 on the CPU: the backend's output and the reference's, before
/// the reference's rounding; `None` where the backend has nothing to check for the case (the
/// statistics of a backend that takes them on the host alone).
pub(super) fn run_op<B: Backend<E = f32>>(
    be: &B,
    op: Op,
    rng: &mut SplitMix,
    ranks: usize,
) -> Result<Option<(Vec<f32>, Vec<f64>)>> {
    let p = be.precision();
    let f64s = Cpu::f64();
    let wide = |m: &Mat<f32>| m.map(f64::from);
    let wide_v = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    Ok(Some(match op {
        Op::Linear { t, k, n } | Op::LinearExact { t, k, n } => {
            let x = mat(rng, t, k, 1.0, p);
            let w = mat(rng, n, k, 1.0 / (k as f32).sqrt(), p);
            let reference = f64s.linear_exact(&wide(&x), &f64s.hold(w.clone())?)?;
            let held = be.hold(w)?;
            let out = if op.exact_output() {
                be.linear_exact(&x, &held)?
            } else {
                be.linear(&x, &held)?
            };
            (out.into_data(), reference.into_data())
        }
        Op::RmsNorm { t, d } => {
            let x = mat(rng, t, d, 1.0, p);
            let w = values(rng, d, 0.5, p);
            let reference = f64s.rms_norm(&wide(&x), &wide_v(&w), 1e-5)?;
            (
                be.rms_norm(&x, &w, 1e-5)?.into_data(),
                reference.into_data(),
            )
        }
        Op::LayerNorm { t, d } => {
            let x = mat(rng, t, d, 2.0, p);
            let (w, b) = (values(rng, d, 0.5, p), values(rng, d, 0.1, p));
            let reference = f64s.layer_norm(&wide(&x), &wide_v(&w), &wide_v(&b), 1e-6)?;
            (
                be.layer_norm(&x, &w, &b, 1e-6)?.into_data(),
                reference.into_data(),
            )
        }
        Op::SiluMul { t, d } => {
            let (g, u) = (mat(rng, t, d, 3.0, p), mat(rng, t, d, 1.0, p));
            let reference = f64s.silu_mul(&wide(&g), &wide(&u))?;
            (be.silu_mul(&g, &u)?.into_data(), reference.into_data())
        }
        Op::Add { t, d } => {
            let (a, b) = (mat(rng, t, d, 1.0, p), mat(rng, t, d, 1.0, p));
            (
                be.add(&a, &b)?.into_data(),
                f64s.add(&wide(&a), &wide(&b))?.into_data(),
            )
        }
        Op::Round { n } => {
            // f32 values, some of them exactly halfway between two values of the dtype.
            let mut xs: Vec<f32> = (0..n).map(|_| rng.normal() * 100.0).collect();
            for x in xs.iter_mut().step_by(7) {
                *x = halfway_above(*x, p);
            }
            let reference = wide_v(&xs);
            be.round(&mut xs)?;
            (xs, reference)
        }
        Op::Rope {
            t,
            heads,
            width,
            offset,
            start,
            interleaved,
        } => {
            let rope_dims = HEAD_DIMS.1;
            let x = mat(rng, t, heads * width, 1.0, p);
            let spec = RotateSpec {
                width,
                offset,
                start,
                interleaved,
            };
            let mut wide_x = wide(&x);
            Rope::<f64>::plain(THETA, rope_dims, 1.0).rotate_rows(&mut wide_x, spec);
            let x = be.rope(&x, &Rope::plain(THETA, rope_dims, 1.0), spec)?;
            (x.into_data(), wide_x.into_data())
        }
        Op::Attention {
            t,
            positions,
            heads,
            sparse,
            poisoned,
        } => {
            let (nope, rope, v) = HEAD_DIMS;
            let q = mat(rng, t, heads * (nope + rope), 1.0, p);
            let mut kv = values(rng, positions * heads * (nope + v), 1.0, p);
            if poisoned {
                // The first value dim of head 0 at the last position, the second of the last
                // head one position before.
                let at = |position: usize, head: usize, dim: usize| {
                    (position * heads + head) * (nope + v) + nope + dim
                };
                kv[at(positions - 1, 0, 0)] = f32::NAN;
                kv[at(positions - 2, heads - 1, 1)] = f32::INFINITY;
            }
            let k_rope = values(rng, positions * rope, 1.0, p);
            let start = positions - t;
            let keys: Vec<Vec<i32>> = (0..t)
                .map(|i| {
                    let seen = (start + i + 1) as i32;
                    if sparse == 0 {
                        return (0..seen).collect();
                    }
                    // `sparse` slots of distinct positions it may see, the last few empty.
                    let mut chosen: Vec<i32> = (0..seen).collect();
                    for s in 0..sparse.min(chosen.len()) {
                        let pick = s + (rng.next_u64() as usize) % (chosen.len() - s);
                        chosen.swap(s, pick);
                    }
                    chosen.truncate(sparse - 3);
                    chosen.extend([-1; 3]);
                    chosen
                })
                .collect();
            let scale = ((nope + rope) as f64).powf(-0.5);
            let shape = |heads| (heads, nope, rope, v, positions);
            let kv = Mat::new(positions, heads * (nope + v), kv);
            let k_rope = Mat::new(positions, rope, k_rope);
            // The sparse cases' earlier positions held as a GPU holds a prompt's while it
            // generates; the dense cases' as the host's.
            let held = sparse > 0;
            let (kv_passes, k_rope_passes) = (
                as_passes(be, &kv, start, held)?,
                as_passes(be, &k_rope, start, held)?,
            );
            let (wq, wkv, wkr) = (wide(&q), [wide(&kv)], [wide(&k_rope)]);
            let reference = f64s
                .attention(&attention_inputs(
                    (&wq, &wkv, &wkr),
                    &keys,
                    shape(heads),
                    scale,
                ))?
                .into_data();
            let out = be
                .attention(&attention_inputs(
                    (&q, &kv_passes, &k_rope_passes),
                    &keys,
                    shape(heads),
                    scale as f32,
                ))?
                .into_data();
            (out, reference)
        }
        Op::ExpertSum { t, d, experts } => {
            let mut outputs = Vec::with_capacity(experts);
            for i in 0..experts {
                let tokens = expert_tokens(t, i);
                let weights = values(rng, tokens.len(), 1.0, Precision::F32);
                let y = mat(rng, tokens.len(), d, 1.0, p);
                // Held where the backend computes, as an op's output is.
                let y = be.add(&y, &Mat::zeros(y.rows, d))?;
                outputs.push((tokens.into_iter().zip(weights).collect::<Vec<_>>(), y));
            }
            let weighted: Vec<WeightedRows<'_, f32>> = outputs
                .iter()
                .map(|(rows, y)| (rows.as_slice(), y))
                .collect();
            let (first, second) = weighted.split_at(experts / 2);
            let sum = be.add_weighted(None, (t, d), first)?;
            let sum = be.add_weighted(Some(sum), (t, d), second)?;
            let out = be.rounded(sum)?.into_data();
            let mut host = Mat::zeros(t, d);
            add_weighted_rows(&mut host, &weighted);
            let reference = host
                .data()
                .iter()
                .map(|&v| f64::from(v.round_to(p)))
                .collect();
            (out, reference)
        }
        Op::Mlp {
            t,
            k,
            inner,
            experts,
        } => {
            let (mut out, mut reference) = (Vec::new(), Vec::new());
            let x = mat(rng, t, k, 1.0, p);
            let (mut picks, mut held, mut wide_held) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..experts {
                picks.push(expert_tokens(t, i));
                let [gate, up, down] = [(inner, k), (inner, k), (k, inner)]
                    .map(|(rows, cols)| mat(rng, rows, cols, 1.0 / (cols as f32).sqrt(), p));
                wide_held.push([
                    f64s.hold(gate.clone())?,
                    f64s.hold(up.clone())?,
                    f64s.hold(down.clone())?,
                ]);
                held.push([be.hold(gate)?, be.hold(up)?, be.hold(down)?]);
            }
            for (rows, [g, u, d]) in picks.iter().zip(&wide_held) {
                reference.extend(f64s.mlp(&wide(&x.gather_rows(rows)), g, u, d)?.into_data());
            }
            let jobs: Vec<_> = picks
                .iter()
                .zip(&held)
                .map(|(rows, [g, u, d])| (rows.as_slice(), [g, u, d]))
                .collect();
            for y in be.mlps(&x, &jobs)? {
                out.extend(y.into_data());
            }
            (out, reference)
        }
        Op::IndexerScores {
            t,
            positions,
            heads,
            dim,
        } => {
            let q = mat(rng, t, heads * dim, 1.0, p);
            let keys = mat(rng, positions, dim, 1.0, p);
            let weights = mat(rng, t, heads, 1.0, p);
            let start = positions - t;
            let power = |n: usize| (n as f64).powf(-0.5);
            let (wq, wk, ww) = (wide(&q), [wide(&keys)], wide(&weights));
            let keys = as_passes(be, &keys, start, false)?;
            let reference = f64s.indexer_scores(&IndexerInputs {
                q: &wq,
                keys: Passes(&wk),
                weights: &ww,
                heads,
                dim,
                start,
                scale: power(dim),
                head_scale: power(heads),
            })?;
            let out = be.indexer_scores(&IndexerInputs {
                q: &q,
                keys: Passes(&keys),
                weights: &weights,
                heads,
                dim,
                start,
                scale: power(dim) as f32,
                head_scale: power(heads) as f32,
            })?;
            causal_scores(out.fetched()?, reference.fetched()?, start, positions)
        }
        Op::Chain { t, d } => {
            let x = mat(rng, t, d, 1.0, p);
            let norm = values(rng, d, 0.5, p);
            let weights = (0..4)
                .map(|_| be.hold(mat(rng, d, d, 1.0 / (d as f32).sqrt(), p)))
                .collect::<Result<Vec<_>>>()?;
            let [a, gate, up, down] = [0, 1, 2, 3].map(|i| &weights[i]);
            let chain = |fresh: bool| -> Result<Vec<f32>> {
                let pass = |m: Mat<f32>| {
                    if fresh {
                        Mat::new(m.rows, m.cols, m.data().to_vec())
                    } else {
                        m
                    }
                };
                let h = pass(be.rms_norm(&x, &norm, 1e-5)?);
                let y = pass(be.linear(&h, a)?);
                // RoPE on the linear's output, in f32: its pass-through columns keep their bits.
                let spec = RotateSpec {
                    width: d / 2,
                    offset: d / 4,
                    start: 3,
                    interleaved: true,
                };
                let r = pass(be.rope(&y, &Rope::plain(THETA, 64.min(d / 4), 1.0), spec)?);
                // Its rotated dims cut out, and the whole rounded to the dtype, where it lies.
                let cut = |width, from, len| HeadCut { width, from, len };
                let rotated = pass(be.head_columns(&r, cut(d / 2, d / 4, d / 4))?);
                // A block of the GEMM's output columns (one head of the whole row), in the dtype.
                let block = pass(be.head_columns(&y, cut(d, d / 3, d / 2))?);
                let rounded = pass(be.rounded(r.clone())?);
                let s = pass(be.add(&rounded, &h)?);
                let g = pass(be.silu_mul(&s, &y)?);
                let m = pass(be.mlp(&g, gate, up, down)?);
                let out = be.linear_exact(&m, a)?;
                Ok([out.data(), r.data(), rotated.data(), block.data()].concat())
            };
            let (kept, fresh) = (chain(false)?, chain(true)?);
            let reference = fresh.iter().map(|&v| f64::from(v)).collect();
            (kept, reference)
        }
        Op::Stats { t, d } => return stats_case(be, t, d, rng),
        Op::AllReduce { t, d } => {
            let parts: Vec<Mat<f32>> = (0..ranks).map(|_| mat(rng, t, d, 1.0, p)).collect();
            let mut reference = vec![0.0f64; t * d];
            for part in &parts {
                reference
                    .iter_mut()
                    .zip(part.data())
                    .for_each(|(s, &v)| *s += f64::from(v));
            }
            (be.all_reduce(&parts)?.into_data(), reference)
        }
    }))
}

/// The [`Op::Stats`] case: a backend output's statistics taken where the backend left it,
/// field by field against the host's of the same values (1 where a field is equal, NaN where
/// not); `None` where the backend leaves nothing elsewhere, so that the host would only be
/// compared with itself.
fn stats_case<B: Backend<E = f32>>(
    be: &B,
    t: usize,
    d: usize,
    rng: &mut SplitMix,
) -> Result<Option<(Vec<f32>, Vec<f64>)>> {
    let mut x = values(rng, t * d, 1.0, be.precision());
    let planted = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0];
    for (i, v) in planted.iter().cycle().take(x.len() / 97).enumerate() {
        x[i * 97 + i % 13] = *v;
    }
    let out = be.add(&Mat::new(t, d, x), &Mat::zeros(t, d))?;
    let Some(later) = out.remote_stats()? else {
        return Ok(None);
    };
    let device = later()?;
    let host = TensorStats::of(out.data());
    let same = |a: f64, b: f64| a.to_bits() == b.to_bits();
    let fields = [
        device.count == host.count,
        same(device.mean, host.mean),
        same(device.std, host.std),
        same(device.min, host.min),
        same(device.max, host.max),
        same(device.absmax, host.absmax),
        same(device.l2, host.l2),
        device.nan == host.nan,
        device.inf == host.inf,
        device.zeros == host.zeros,
        device.hash == host.hash,
        device.sketch.len() == host.sketch.len()
            && device
                .sketch
                .iter()
                .zip(&host.sketch)
                .all(|(a, b)| same(*a, *b)),
    ];
    let out = fields.map(|ok| if ok { 1.0 } else { f32::NAN });
    Ok(Some((out.to_vec(), vec![1.0; fields.len()])))
}

/// The tokens of `t` that routed expert `i` of the `mlp` case runs on: the first
/// `max(t - i, 1)`, last first, so that the rows are picked out of order.
fn expert_tokens(t: usize, i: usize) -> Vec<usize> {
    (0..t.saturating_sub(i).max(1)).rev().collect()
}

/// The scores of keys up to each query's position, from the backend's `[t, positions]` and the
/// reference's; a score past a query's position that is not −∞ becomes a NaN, failing the case.
fn causal_scores(
    out: &[f32],
    reference: &[f64],
    start: usize,
    positions: usize,
) -> (Vec<f32>, Vec<f64>) {
    let (mut seen, mut wide) = (Vec::new(), Vec::new());
    for (i, (row, ref_row)) in out
        .chunks(positions)
        .zip(reference.chunks(positions))
        .enumerate()
    {
        let p = start + i;
        seen.extend_from_slice(&row[..=p]);
        wide.extend_from_slice(&ref_row[..=p]);
        if row[p + 1..].iter().any(|&v| v != f32::NEG_INFINITY) {
            seen.push(f32::NAN);
            wide.push(0.0);
        }
    }
    if out.len() != reference.len() {
        seen.push(f32::NAN);
    }
    (seen, wide)
}
