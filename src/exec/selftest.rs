//! Every op of a [`Backend`] on fresh random inputs against the same op computed in f64 on the
//! CPU and rounded once to the op's output dtype, as a table of cases (llama.cpp's
//! `test-backend-ops` is the model). A case passes when the normalised mean squared error
//! `Σ(out − ref)² / Σ ref²` stays within what the op's roundings allow (see [`limit`]).

use anyhow::Result;
use serde::Serialize;

use super::attention_core::AttentionInputs;
use super::backend::{add_weighted_rows, Backend, Cpu, HeadCut, WeightedRows};
use super::indexer_core::IndexerInputs;
use super::mat::Mat;
use super::passes::Passes;
use super::real::Real;
use super::rope::{Rope, RotateSpec};
use crate::dtype::Precision;
use crate::rng::SplitMix;
use crate::trace::stats::TensorStats;

/// One op at one shape.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    /// `x[t, k] · w[n, k]ᵀ`, output in the dtype.
    Linear {
        t: usize,
        k: usize,
        n: usize,
    },
    /// The same, output kept in f32 (the router).
    LinearExact {
        t: usize,
        k: usize,
        n: usize,
    },
    RmsNorm {
        t: usize,
        d: usize,
    },
    LayerNorm {
        t: usize,
        d: usize,
    },
    SiluMul {
        t: usize,
        d: usize,
    },
    Add {
        t: usize,
        d: usize,
    },
    /// f32 values to the dtype.
    Round {
        n: usize,
    },
    /// The sum of one `[t, d]` part per rank.
    AllReduce {
        t: usize,
        d: usize,
    },
    /// RoPE on `t` rows of `heads` heads of `width` values, the 64 rope dims from `offset`,
    /// positions from `start`, interleaved pairs or NeoX halves.
    Rope {
        t: usize,
        heads: usize,
        width: usize,
        offset: usize,
        start: usize,
        interleaved: bool,
    },
    /// Gated MLPs (routed experts) run as one group on rows of one `[t, k]` input: `experts`
    /// of them, expert `i` on `max(t - i, 1)` of its rows, `inner` intermediate features.
    Mlp {
        t: usize,
        k: usize,
        inner: usize,
        experts: usize,
    },
    /// Routed experts' outputs (rows of `[t, d]` that a backend holds, as its ops leave them)
    /// added into each token's row by their routing weights in two groups, then rounded to the
    /// dtype: the backend's sum must be the host's, bit for bit (each token's experts in order,
    /// each product rounded before its add).
    ExpertSum {
        t: usize,
        d: usize,
        experts: usize,
    },
    /// The DSA indexer's scores of `t` new positions against `positions` cached keys, `heads`
    /// query heads of `dim`.
    IndexerScores {
        t: usize,
        positions: usize,
        heads: usize,
        dim: usize,
    },
    /// MLA attention of `t` new positions over `positions` cached ones (GLM-5's head dims:
    /// no-RoPE 192, RoPE 64, value 256), each seeing every position up to its own, or (`sparse`)
    /// a DSA-like choice of `sparse` of them; `poisoned`: a NaN and an infinity in the values
    /// of the last two positions, which the earlier queries do not see and must not be touched
    /// by.
    Attention {
        t: usize,
        positions: usize,
        heads: usize,
        sparse: usize,
        poisoned: bool,
    },
    /// Ops fed each other's outputs on `[t, d]` (rms_norm, linear, RoPE, head_columns,
    /// rounded, add, silu_mul, one MLP, linear_exact), against the same chain given fresh host
    /// copies between the ops: a backend that keeps an output on its device for the next op
    /// must give the same bits.
    Chain {
        t: usize,
        d: usize,
    },
    /// A recorded stage's statistics and content hash where a backend computes them on its
    /// device (an op's output left there), against the host's of the same values: `[t, d]`
    /// with NaN, ±Inf and zeros of both signs planted, every field equal or the case fails.
    /// Skipped on a backend that takes statistics on the host alone (the CPU).
    Stats {
        t: usize,
        d: usize,
    },
}

/// The cases: GLM-5's own widths (hidden 6144, q_lora 2048, kv_lora 512, expert 2048, 64
/// experts' router) and odd sizes that leave partial blocks and warps.
pub const CASES: [Op; 30] = [
    Op::Linear {
        t: 8,
        k: 6144,
        n: 512,
    },
    Op::Linear {
        t: 1,
        k: 2048,
        n: 2048,
    },
    Op::Linear {
        t: 5,
        k: 333,
        n: 77,
    },
    Op::LinearExact {
        t: 8,
        k: 6144,
        n: 256,
    },
    Op::LinearExact { t: 3, k: 100, n: 9 },
    Op::RmsNorm { t: 8, d: 6144 },
    Op::RmsNorm { t: 3, d: 513 },
    Op::LayerNorm { t: 8, d: 128 },
    Op::LayerNorm { t: 2, d: 1001 },
    Op::SiluMul { t: 8, d: 2048 },
    Op::SiluMul { t: 1, d: 999 },
    Op::Add { t: 8, d: 6144 },
    Op::Mlp {
        t: 6,
        k: 6144,
        inner: 2048,
        experts: 3,
    },
    Op::Mlp {
        t: 1,
        k: 300,
        inner: 77,
        experts: 1,
    },
    // Experts of many tokens and of fewer side by side (a GPU runs the first a GEMM each).
    Op::Mlp {
        t: 130,
        k: 256,
        inner: 96,
        experts: 4,
    },
    Op::ExpertSum {
        t: 9,
        d: 300,
        experts: 6,
    },
    Op::Round { n: 100_003 },
    Op::AllReduce { t: 8, d: 6144 },
    Op::Rope {
        t: 5,
        heads: 8,
        width: 256,
        offset: 192,
        start: 100,
        interleaved: true,
    },
    Op::Rope {
        t: 3,
        heads: 32,
        width: 128,
        offset: 0,
        start: 7,
        interleaved: false,
    },
    Op::IndexerScores {
        t: 4,
        positions: 300,
        heads: 32,
        dim: 128,
    },
    Op::IndexerScores {
        t: 3,
        positions: 37,
        heads: 5,
        dim: 33,
    },
    Op::Attention {
        t: 5,
        positions: 12,
        heads: 8,
        sparse: 0,
        poisoned: false,
    },
    Op::Attention {
        t: 4,
        positions: 300,
        heads: 4,
        sparse: 64,
        poisoned: false,
    },
    Op::Chain { t: 7, d: 384 },
    // Past the size a GPU takes statistics from (2²⁰ values): whole chunks of the sums and hash
    // pieces; then the last ones partial and the last hash word half padding.
    Op::Stats { t: 1024, d: 1024 },
    Op::Stats { t: 1025, d: 1031 },
    // More positions, dense (a prompt: the whole cache is this pass's) and sparse.
    Op::Attention {
        t: 37,
        positions: 37,
        heads: 3,
        sparse: 0,
        poisoned: false,
    },
    Op::Attention {
        t: 16,
        positions: 40,
        heads: 2,
        sparse: 24,
        poisoned: false,
    },
    // A NaN and an infinity in values that only the last queries see.
    Op::Attention {
        t: 24,
        positions: 30,
        heads: 2,
        sparse: 0,
        poisoned: true,
    },
];

/// RoPE's base in the cases that rotate (GLM-5's `rope_theta`).
const THETA: f64 = 1e6;

/// GLM-5's head dims: no-RoPE, RoPE and value.
const HEAD_DIMS: (usize, usize, usize) = (192, 64, 256);

/// One row of the table.
#[derive(Clone, Debug, Serialize)]
pub struct Outcome {
    pub op: &'static str,
    pub shape: String,
    pub dtype: &'static str,
    pub nmse: f64,
    pub limit: f64,
    pub max_abs_err: f64,
    pub pass: bool,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Linear { .. } => "linear",
            Op::LinearExact { .. } => "linear_exact",
            Op::RmsNorm { .. } => "rms_norm",
            Op::LayerNorm { .. } => "layer_norm",
            Op::SiluMul { .. } => "silu_mul",
            Op::Add { .. } => "add",
            Op::Round { .. } => "round",
            Op::AllReduce { .. } => "all_reduce",
            Op::Rope {
                interleaved: true, ..
            } => "rope",
            Op::Rope { .. } => "rope_neox",
            Op::Mlp { .. } => "mlp",
            Op::ExpertSum { .. } => "expert_sum",
            Op::IndexerScores { .. } => "indexer_scores",
            Op::Attention { poisoned: true, .. } => "attention_nonfinite",
            Op::Attention { sparse: 0, .. } => "attention",
            Op::Attention { .. } => "attention_dsa",
            Op::Chain { .. } => "chain",
            Op::Stats { .. } => "stats",
        }
    }

    fn shape(self, ranks: usize) -> String {
        match self {
            Op::Linear { t, k, n } | Op::LinearExact { t, k, n } => format!("[{t},{k}]·[{n},{k}]ᵀ"),
            Op::RmsNorm { t, d }
            | Op::LayerNorm { t, d }
            | Op::SiluMul { t, d }
            | Op::Add { t, d } => format!("[{t},{d}]"),
            Op::Chain { t, d } => format!("[{t},{d}] through 10 ops"),
            Op::Stats { t, d } => format!("[{t},{d}], 12 fields"),
            Op::Round { n } => format!("[{n}]"),
            Op::Mlp {
                t,
                k,
                inner,
                experts,
            } => format!("{experts} × [{t},{k}] through {inner}"),
            Op::ExpertSum { t, d, experts } => {
                format!("{experts} experts' rows into [{t},{d}], two groups")
            }
            Op::IndexerScores {
                t,
                positions,
                heads,
                dim,
            } => format!("{t} of {positions} positions, {heads} heads of {dim}"),
            Op::AllReduce { t, d } => format!("{ranks}×[{t},{d}]"),
            Op::Rope {
                t,
                heads,
                width,
                offset,
                start,
                ..
            } => format!("[{t},{heads}×{width}] from {offset}, positions {start}.."),
            Op::Attention {
                t,
                positions,
                heads,
                sparse,
                poisoned,
            } => {
                let seen = if sparse > 0 {
                    format!(", {sparse} keys")
                } else {
                    String::new()
                };
                let poison = if poisoned {
                    ", NaN and ∞ in the last two values"
                } else {
                    ""
                };
                format!("{t} of {positions} positions, {heads} heads{seen}{poison}")
            }
        }
    }

    /// Whether the output is held in f32 whatever the dtype.
    fn exact_output(self) -> bool {
        matches!(
            self,
            Op::LinearExact { .. }
                | Op::Chain { .. }
                | Op::Stats { .. }
                | Op::Attention { .. }
                | Op::Rope { .. }
                | Op::IndexerScores { .. }
        )
    }

    /// Roundings to the output dtype between the inputs and the output.
    fn roundings(self, ranks: usize) -> usize {
        match self {
            Op::AllReduce { .. } => ranks.saturating_sub(1).max(1),
            _ => 1,
        }
    }
}

/// The NMSE an op may show: each of its `r` roundings moves a value by at most `u` (relative),
/// the f64 reference is rounded once more, so every value is off by at most `(r + 1)·u` relative
/// and the NMSE by its square. In f32 the accumulation order of a `k`-term sum adds up to `k·u`
/// per value (rounding errors of a random-order sum grow as `√k` in practice, so `k·u²` is the
/// bound used). `round`, the chain, the statistics and the experts' sum must be exact.
pub fn limit(op: Op, dtype: Precision, ranks: usize) -> f64 {
    if matches!(
        op,
        Op::Round { .. } | Op::Chain { .. } | Op::Stats { .. } | Op::ExpertSum { .. }
    ) {
        return 0.0;
    }
    if let Op::Rope { t, start, .. } = op {
        // The angle position · frequency is rounded to f32 before its sine and cosine, as
        // transformers computes it: an error of up to angle · u (the largest frequency is 1).
        let angle = (start + t) as f64;
        return ((2.0 + angle) * Precision::F32.unit_roundoff()).powi(2);
    }
    let out = if op.exact_output() {
        Precision::F32
    } else {
        dtype
    };
    let u = out.unit_roundoff();
    let r = (op.roundings(ranks) + 1) as f64;
    let terms = match op {
        Op::Linear { k, .. } | Op::LinearExact { k, .. } => k,
        Op::RmsNorm { d, .. } | Op::LayerNorm { d, .. } => d,
        // A score sums no-RoPE and RoPE products; the softmax and the value mix sum over the
        // positions.
        Op::Attention { positions, .. } => HEAD_DIMS.0 + HEAD_DIMS.1 + 2 * positions,
        Op::Mlp { k, inner, .. } => k + inner,
        // Every head's dot product and the sum over heads.
        Op::IndexerScores { heads, dim, .. } => heads * dim,
        _ => 1,
    };
    let accumulation = terms as f64 * Precision::F32.unit_roundoff().powi(2);
    (r * u).powi(2) + accumulation
}

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
fn run_op<B: Backend<E = f32>>(
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

/// Every case on `be` (with `ranks` ranks for the all-reduce) from random seed `seed`.
pub fn run<B: Backend<E = f32>>(be: &B, ranks: usize, seed: u64) -> Result<Vec<Outcome>> {
    let dtype = be.precision();
    let mut rng = SplitMix::new(seed);
    let mut outcomes = Vec::new();
    for op in CASES {
        if matches!(op, Op::AllReduce { .. }) && ranks < 2 {
            continue;
        }
        let Some((out, reference)) = run_op(be, op, &mut rng, ranks)? else {
            continue;
        };
        let out_dtype = if op.exact_output() {
            Precision::F32
        } else {
            dtype
        };
        let (mut err, mut norm, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
        // A NaN or infinity must be where the reference has the same; it adds no error there.
        let mut misplaced = 0usize;
        for (&o, &r) in out.iter().zip(&reference) {
            let r = r.round_to(out_dtype);
            if !(o.is_finite() && r.is_finite()) {
                let same = (o.is_nan() && r.is_nan()) || f64::from(o) == r;
                misplaced += usize::from(!same);
                continue;
            }
            let d = f64::from(o) - r;
            err += d * d;
            norm += r * r;
            max_abs = max_abs.max(d.abs());
        }
        let nmse = if out.len() == reference.len() && misplaced == 0 {
            err / norm.max(f64::MIN_POSITIVE)
        } else {
            f64::INFINITY
        };
        let limit = limit(op, dtype, ranks);
        outcomes.push(Outcome {
            op: op.name(),
            shape: op.shape(ranks),
            dtype: dtype.name(),
            nmse,
            limit,
            max_abs_err: max_abs,
            pass: nmse <= limit,
        });
    }
    Ok(outcomes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::host_weight::HostWeight;
    use crate::trace::stats::StatsLater;

    #[test]
    fn the_cpu_backend_passes_at_every_precision_and_a_wrong_op_fails() {
        for p in [Precision::F32, Precision::Bf16, Precision::F16] {
            let outcomes = run(&Cpu::new(p), 3, 7).unwrap();
            for o in &outcomes {
                assert!(o.pass, "{o:?}");
            }
            // The device's statistics are not checked where there is no device.
            let stats_cases = CASES.iter().filter(|op| op.name() == "stats").count();
            assert_eq!(outcomes.len(), CASES.len() - stats_cases);
            assert!(outcomes.iter().all(|o| o.op != "stats"));
        }
        /// A broken backend: rounding to bf16 by truncation instead of to nearest, or leaving
        /// its sums "on a device" whose statistics' hash is off by one bit.
        #[derive(Clone, Copy, PartialEq)]
        enum Fault {
            TruncatingRound,
            SkewedStats,
        }
        /// Values left "elsewhere" with statistics whose hash differs from the values'.
        struct Skewed(Vec<f32>);
        impl crate::exec::mat::Remote for Skewed {
            fn fetch(&self) -> Result<Vec<f32>> {
                Ok(self.0.clone())
            }
            fn stats(self: std::sync::Arc<Self>) -> Result<Option<StatsLater>> {
                let mut stats = TensorStats::of(&self.0);
                stats.hash ^= 1;
                Ok(Some(Box::new(move || Ok(stats))))
            }
        }
        #[derive(Clone)]
        struct Faulty(Cpu<f32>, Fault);
        impl Backend for Faulty {
            type E = f32;
            type Weight = HostWeight<f32>;
            fn name(&self) -> &'static str {
                "faulty"
            }
            fn kept_experts_join_any_group(&self) -> bool {
                false
            }
            fn precision(&self) -> Precision {
                Precision::Bf16
            }
            fn hold(&self, w: Mat<f32>) -> Result<HostWeight<f32>> {
                self.0.hold(w)
            }
            fn hold_values(&self, v: Vec<f32>) -> Vec<f32> {
                self.0.hold_values(v)
            }
            fn hold_exact(&self, v: Vec<f32>) -> Vec<f32> {
                v
            }
            fn linear(&self, x: &Mat<f32>, w: &HostWeight<f32>) -> Result<Mat<f32>> {
                self.0.linear(x, w)
            }
            fn linear_exact(&self, x: &Mat<f32>, w: &HostWeight<f32>) -> Result<Mat<f32>> {
                self.0.linear_exact(x, w)
            }
            fn rms_norm(&self, x: &Mat<f32>, w: &[f32], eps: f64) -> Result<Mat<f32>> {
                self.0.rms_norm(x, w, eps)
            }
            fn layer_norm(&self, x: &Mat<f32>, w: &[f32], b: &[f32], e: f64) -> Result<Mat<f32>> {
                self.0.layer_norm(x, w, b, e)
            }
            fn silu_mul(&self, g: &Mat<f32>, u: &Mat<f32>) -> Result<Mat<f32>> {
                self.0.silu_mul(g, u)
            }
            fn add(&self, a: &Mat<f32>, b: &Mat<f32>) -> Result<Mat<f32>> {
                let sum = self.0.add(a, b)?;
                if self.1 != Fault::SkewedStats {
                    return Ok(sum);
                }
                Ok(Mat::remote(sum.rows, sum.cols, Skewed(sum.into_data())))
            }
            fn round(&self, xs: &mut [f32]) -> Result<()> {
                if self.1 != Fault::TruncatingRound {
                    return self.0.round(xs);
                }
                xs.iter_mut()
                    .for_each(|x| *x = f32::from_bits(x.to_bits() & 0xffff_0000));
                Ok(())
            }
        }
        // The exact `round` and `expert_sum` cases catch the truncation; `stats` the skewed
        // hash, once per case (the values themselves are right, so every other case passes).
        for (fault, want) in [
            (Fault::TruncatingRound, vec!["expert_sum", "round"]),
            (Fault::SkewedStats, vec!["stats", "stats"]),
        ] {
            let outcomes = run(&Faulty(Cpu::new(Precision::Bf16), fault), 1, 7).unwrap();
            let failed: Vec<_> = outcomes.iter().filter(|o| !o.pass).map(|o| o.op).collect();
            assert_eq!(failed, want);
        }
    }
}
