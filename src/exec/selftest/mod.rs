//! Every op of a [`Backend`] on fresh random inputs against the same op computed in f64 on the
//! CPU and rounded once to the op's output dtype, as a table of cases (llama.cpp's
//! `test-backend-ops` is the model). A case passes when the normalised mean squared error
//! `Σ(out − ref)² / Σ ref²` stays within what the op's roundings allow (see [`limit`]).

mod run_op;

use anyhow::Result;
use serde::Serialize;

use crate::dtype::Precision;
use crate::exec::backend::Backend;
use crate::exec::real::Real;
use crate::rng::SplitMix;
use run_op::run_op;

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
    use crate::exec::backend::Cpu;
    use crate::exec::cpu::host_weight::HostWeight;
    use crate::exec::mat::Mat;
    use crate::trace::stats::{StatsLater, TensorStats};

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
