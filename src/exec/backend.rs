//! The ops of the forward behind one trait, so that the same forward runs on every backend, and
//! the CPU backend at each precision.
//!
//! The CPU reference runs every op in f32 (or f64). Its bf16 and f16 modes emulate a GPU engine:
//! weights are held in the dtype, each op accumulates in f32 and rounds its output to the dtype
//! (what cuBLAS GEMMs with f32 accumulation and fused norm kernels do), while the router stays in
//! f32 as GLM-5 engines keep it. The difference between the f32 and the emulated runs is the
//! noise envelope a candidate at that dtype is judged against.

use std::marker::PhantomData;

use anyhow::{bail, Context, Result};
use rayon::prelude::*;

use super::ops;
use crate::exec::cpu::host_linear;
use crate::exec::cpu::host_weight::{Blocks, HostWeight};
use crate::exec::mat::Mat;
use crate::exec::ops::attention_core::{attention_core, AttentionInputs};
use crate::exec::ops::indexer_core::{indexer_scores_core, IndexerInputs};
use crate::exec::ops::op_clock::Op;
use crate::exec::ops::rope::{Rope, RotateSpec};
use crate::exec::storage::claim::{claim_host, Claim};
use crate::exec::storage::stored::{BlockBytes, StoredBlock};

use crate::dtype::Precision;
use crate::exec::real::Real;
use crate::model::kv_b::{assemble_kv_b_by_heads, KvBDims, KvBSizeError};
use crate::weights::{quant, GgmlType};

/// One gated MLP of [`Backend::mlps`]: the rows of the shared input it runs on (a routed
/// expert's tokens) and its `[gate, up, down]` as backend weights `W`.
pub type MlpJob<'a, W> = (&'a [usize], [&'a W; 3]);

/// One routed expert's output for [`Backend::add_weighted`]: for each of its rows, the token
/// it belongs to and that token's routing weight; and the rows.
pub type WeightedRows<'a, E> = (&'a [(usize, E)], &'a Mat<E>);

/// The ops the forward calls. Activations are host matrices in the backend's number type;
/// weights arrive as stored blocks or dequantized to f32, and the backend holds them its own way
/// (in its dtype, where it computes).
pub trait Backend: Sync + Clone {
    type E: Real;
    /// A matrix weight `[out, in]` as the backend holds it.
    type Weight: Send + Sync + 'static;

    /// The name traces record (`cpu`, `cuda`).
    fn name(&self) -> &'static str;
    fn precision(&self) -> Precision;
    /// A matrix weight, rounded to the dtype.
    fn hold(&self, w: Mat<f32>) -> Result<Self::Weight>;
    /// A block of a weight as the file stores it, rounded to the dtype: dequantized on the host
    /// here; a GPU backend dequantizes the blocks on its device.
    fn hold_stored(&self, w: &StoredBlock<'_>) -> Result<Self::Weight> {
        self.hold(w.dequantize()?)
    }
    /// kv_b (or a block of its heads) assembled from llama.cpp's split `attn_k_b` and
    /// `attn_v_b` blocks, rounded to the dtype: on the host here; a GPU backend assembles it on
    /// its device.
    fn hold_kv_b(
        &self,
        k_b: &StoredBlock<'_>,
        v_b: &StoredBlock<'_>,
        d: KvBDims,
    ) -> Result<Self::Weight> {
        self.hold(kv_b_on_host(k_b, v_b, d)?)
    }
    /// Values rounded to the dtype (norm weights, embedding rows).
    fn hold_values(&self, v: Vec<f32>) -> Vec<Self::E>;
    /// Values kept exactly (the expert-choice bias engines keep in f32).
    fn hold_exact(&self, v: Vec<f32>) -> Vec<Self::E>;
    /// `m` (values the dtype holds) also where the backend computes, for the ops that read it
    /// (the embedding: the first norm and the first residual add); the CPU's is the host's.
    fn placed(&self, m: Mat<Self::E>) -> Result<Mat<Self::E>> {
        Ok(m)
    }
    /// `x · wᵀ`, rounded to the dtype.
    fn linear(&self, x: &Mat<Self::E>, w: &Self::Weight) -> Result<Mat<Self::E>>;
    /// `x · wᵀ` left unrounded (the router, which engines run in f32).
    fn linear_exact(&self, x: &Mat<Self::E>, w: &Self::Weight) -> Result<Mat<Self::E>>;
    fn rms_norm(&self, x: &Mat<Self::E>, w: &[Self::E], eps: f64) -> Result<Mat<Self::E>>;
    fn layer_norm(
        &self,
        x: &Mat<Self::E>,
        w: &[Self::E],
        b: &[Self::E],
        eps: f64,
    ) -> Result<Mat<Self::E>>;
    fn silu_mul(&self, gate: &Mat<Self::E>, up: &Mat<Self::E>) -> Result<Mat<Self::E>>;
    /// A residual add, the sum held in the dtype.
    fn add(&self, a: &Mat<Self::E>, b: &Mat<Self::E>) -> Result<Mat<Self::E>>;
    /// Round values produced outside these ops (RoPE, attention context, weighted expert sums).
    fn round(&self, xs: &mut [Self::E]) -> Result<()>;
    /// `m` rounded as [`Self::round`] rounds; a GPU backend rounds an output it still holds
    /// there.
    fn rounded(&self, mut m: Mat<Self::E>) -> Result<Mat<Self::E>> {
        self.round(m.data_mut())?;
        Ok(m)
    }
    /// `sum` (zeros of `rows × cols` where `None`) with each routed expert's output rows, times
    /// their tokens' routing weights, added to their tokens' rows: each token's experts in
    /// `outputs`' order, `o + w·v` with the product rounded before the add, unrounded to the
    /// dtype. By default on the host's cores ([`add_weighted_rows`]); a GPU backend adds the
    /// outputs it still holds there.
    fn add_weighted(
        &self,
        sum: Option<Mat<Self::E>>,
        (rows, cols): (usize, usize),
        outputs: &[WeightedRows<'_, Self::E>],
    ) -> Result<Mat<Self::E>> {
        Ok(weighted_on_host(sum, (rows, cols), outputs))
    }
    /// `m` with RoPE on the heads of every row as `spec` says, unrounded (a new matrix: the
    /// forward records the query before and after); by default the CPU's loops.
    fn rope(
        &self,
        m: &Mat<Self::E>,
        rope: &Rope<Self::E>,
        spec: RotateSpec,
    ) -> Result<Mat<Self::E>> {
        let mut out = m.clone();
        rope.rotate_rows(&mut out, spec);
        Ok(out)
    }
    /// The columns `cut` names of each head in `m`'s rows (the rotated RoPE dims of a query;
    /// the latent and the RoPE key of kv_a's output, a row being one head): `[rows, heads ·
    /// cut.len]`; by default on the host's cores.
    fn head_columns(&self, m: &Mat<Self::E>, cut: HeadCut) -> Result<Mat<Self::E>> {
        head_columns_on_host(m, cut)
    }
    /// MLA attention of new positions over the cache, the context `[t, heads · v]` unrounded
    /// (see [`AttentionInputs`]); by default the CPU's loops.
    fn attention(&self, a: &AttentionInputs<'_, Self::E>) -> Result<Mat<Self::E>> {
        Ok(Mat::new(a.q.rows, a.heads * a.v, attention_core(a)))
    }
    /// The DSA indexer's scores `[t, positions]` of new positions against every cached key,
    /// unrounded (see [`IndexerInputs`]); by default the CPU's loops.
    fn indexer_scores(&self, a: &IndexerInputs<'_, Self::E>) -> Result<Mat<Self::E>> {
        Ok(Mat::new(a.q.rows, a.positions(), indexer_scores_core(a)))
    }
    /// A gated MLP whose three weights are held at once (a routed expert; a dense layer's MLP
    /// and the shared expert at TP 1 where [`Self::fuses_mlp`]),
    /// `down(silu(x · gateᵀ) ⊙ x · upᵀ)`, each op rounded as on its own; a GPU backend keeps the
    /// intermediates on its device.
    fn mlp(
        &self,
        x: &Mat<Self::E>,
        gate: &Self::Weight,
        up: &Self::Weight,
        down: &Self::Weight,
    ) -> Result<Mat<Self::E>> {
        let h = self.silu_mul(&self.linear(x, gate)?, &self.linear(x, up)?)?;
        self.linear(&h, down)
    }
    /// Several gated MLPs ([`Self::mlp`]), each on its rows of `x` (routed experts on the
    /// tokens that chose them): here in parallel, each on its rows copied out; a GPU backend
    /// picks the rows out on its device and fetches the outputs in one copy.
    fn mlps(
        &self,
        x: &Mat<Self::E>,
        jobs: &[MlpJob<'_, Self::Weight>],
    ) -> Result<Vec<Mat<Self::E>>> {
        jobs.par_iter()
            .map(|(rows, [gate, up, down])| self.mlp(&x.gather_rows(rows), gate, up, down))
            .collect()
    }
    /// Whether a dense MLP is better run as one [`Self::mlp`] with its three weights held at
    /// once than op by op with one weight at a time: on a GPU the intermediates then stay on
    /// the device; on the CPU it would only hold three weights (900 MB in f32 at GLM-5's dense
    /// widths) where one at a time does.
    fn fuses_mlp(&self) -> bool {
        false
    }
    /// How many routed experts to hold and run at once through [`Self::mlps`]: on the CPU
    /// enough to keep the cores busy on small experts, few enough that memory stays at a
    /// handful of experts whatever the core count.
    fn experts_at_once(&self) -> usize {
        4
    }
    /// Whether a routed expert whose weights a run keeps from an earlier pass joins a group
    /// beyond [`Self::experts_at_once`]: where the kept weights are what the op multiplies by
    /// (a GPU keeps them dequantized), running them with the group costs no memory, and fewer,
    /// larger groups cost fewer launches. No default, so that a wrapper cannot leave it
    /// undelegated.
    fn kept_experts_join_any_group(&self) -> bool;
    /// The backend as tensor-parallel rank `rank` runs it: on its own GPU, where there is one
    /// per rank. Weights held through it live there.
    fn on_rank(&self, _rank: usize) -> Self {
        self.clone()
    }
    /// Whether this process computes rank `rank`'s shards: every rank, unless each rank runs in
    /// a process of its own.
    fn computes(&self, _rank: usize) -> bool {
        true
    }
    /// Whether collectives cross process boundaries (a process per rank): then every process
    /// must issue them in the same order, so work that reaches them runs one item at a time.
    fn collectives_across_processes(&self) -> bool {
        false
    }
    /// Whether the forward should ask for stored weights to be read into the page cache ahead
    /// of their use ([`crate::weights::read_ahead`]): where this backend reads them from the
    /// files each time it holds them (the CPU), not where it may keep them on its device.
    fn reads_ahead(&self) -> bool {
        false
    }
    /// A claim on the memory that holds `w`, for a run that keeps weights between passes
    /// ([`crate::exec::source::kept`]); `None` where it does not fit (or the backend keeps nothing).
    fn claim_kept(&self, _w: &Self::Weight) -> Result<Option<Claim>> {
        Ok(None)
    }
    /// Every rank's part from those this process computed (`None` for the others'): an
    /// all-gather when ranks are processes, so that every process goes on with all of them.
    fn gather(&self, parts: Vec<Option<Mat<Self::E>>>) -> Result<Vec<Mat<Self::E>>> {
        all_computed(parts)
    }
    /// The sum of the ranks' partial results (an all-reduce), held in the dtype. By default in
    /// rank order, one rounding per add.
    fn all_reduce(&self, parts: &[Mat<Self::E>]) -> Result<Mat<Self::E>> {
        sum_in_rank_order(self, parts)
    }
    /// `f`, the forward's own host work named `step` (one of [`Op`]'s host steps): timed
    /// where the backend keeps an [`crate::exec::ops::op_clock::OpClock`], else just run.
    fn host<T>(&self, _step: Op, f: impl FnOnce() -> T) -> T {
        f()
    }
}

/// kv_b (or a block of its heads) dequantized and assembled on the host from llama.cpp's split
/// blocks.
pub fn kv_b_on_host(k_b: &StoredBlock<'_>, v_b: &StoredBlock<'_>, d: KvBDims) -> Result<Mat<f32>> {
    let k = HeadRows::of(k_b, ("attn_k_b", d.k_b_len(), d.kv_lora * d.nope), d)?;
    let v = HeadRows::of(v_b, ("attn_v_b", d.v_b_len(), d.v * d.kv_lora), d)?;
    let kv_b = assemble_kv_b_by_heads(d, |h, k_head, uv| {
        k.decode(h, k_head)?;
        v.decode(h, uv)
    })?;
    Ok(Mat::new(d.heads * (d.nope + d.v), d.kv_lora, kv_b))
}

/// A split kv_b part's blocks, decoded a head's rows at a time straight to where they go.
struct HeadRows {
    ty: GgmlType,
    bytes: BlockBytes,
    row_len: usize,
    head_rows: usize,
    origin: String,
}

impl HeadRows {
    /// `w`'s blocks, each head `per_head` values of whole rows; `(part, len, per_head)`.
    fn of(
        w: &StoredBlock<'_>,
        (part, len, per_head): (&'static str, usize, usize),
        d: KvBDims,
    ) -> Result<HeadRows> {
        let (rows, cols) = w.shape();
        let origin = w.origin();
        if rows * cols != len {
            let error = KvBSizeError {
                part,
                got: rows * cols,
                expected: len,
                dims: d,
            };
            bail!("{origin}: {error}");
        }
        if cols == 0 || per_head % cols != 0 {
            bail!("{origin}: rows of {cols} values do not split into heads of {per_head}");
        }
        Ok(HeadRows {
            ty: w.ty(),
            bytes: w.blocks()?,
            row_len: cols,
            head_rows: per_head / cols,
            origin,
        })
    }

    /// Head `h`'s values into `out`, a row at a time.
    fn decode(&self, h: usize, out: &mut [f32]) -> Result<()> {
        if out.len() != self.head_rows * self.row_len {
            bail!(
                "{}: a head of {} values into {}",
                self.origin,
                self.head_rows * self.row_len,
                out.len()
            );
        }
        let rows = self
            .bytes
            .rows(h * self.head_rows..(h + 1) * self.head_rows);
        for (blocks, values) in rows.zip(out.chunks_exact_mut(self.row_len)) {
            quant::dequantize(self.ty, blocks, values).with_context(|| self.origin.clone())?;
        }
        Ok(())
    }
}

/// Every rank's part, computed in this process.
pub fn all_computed<E>(parts: Vec<Option<Mat<E>>>) -> Result<Vec<Mat<E>>> {
    parts
        .into_iter()
        .enumerate()
        .map(|(r, p)| p.ok_or_else(|| anyhow::anyhow!("rank {r}'s part was not computed here")))
        .collect()
}

/// Columns `from..from + len` of each head of `width` values, the heads side by side in a
/// matrix's rows.
#[derive(Clone, Copy, Debug)]
pub struct HeadCut {
    pub width: usize,
    pub from: usize,
    pub len: usize,
}

impl HeadCut {
    /// The heads in rows of `cols` values, where they hold the cut's columns.
    pub fn heads_in(self, cols: usize) -> Result<usize> {
        if self.width == 0 || self.from + self.len > self.width || !cols.is_multiple_of(self.width)
        {
            bail!(
                "head columns: rows of {cols} values do not hold heads of {} with columns {}..{}",
                self.width,
                self.from,
                self.from + self.len
            );
        }
        Ok(cols / self.width)
    }
}

/// [`Backend::head_columns`] on the host's cores.
pub fn head_columns_on_host<E: Real>(m: &Mat<E>, cut: HeadCut) -> Result<Mat<E>> {
    let heads = cut.heads_in(m.cols)?;
    let mut out = vec![E::zero(); m.rows * heads * cut.len];
    if !out.is_empty() {
        out.par_chunks_mut(cut.len)
            .zip(m.data().par_chunks_exact(cut.width))
            .for_each(|(to, head)| to.copy_from_slice(&head[cut.from..cut.from + cut.len]));
    }
    Ok(Mat::new(m.rows, heads * cut.len, out))
}

/// [`Backend::add_weighted`] on the host's cores.
pub fn weighted_on_host<E: Real>(
    sum: Option<Mat<E>>,
    (rows, cols): (usize, usize),
    outputs: &[WeightedRows<'_, E>],
) -> Mat<E> {
    let mut sum = sum.unwrap_or_else(|| Mat::zeros(rows, cols));
    add_weighted_rows(&mut sum, outputs);
    sum
}

/// Adds each output's rows, times their routing weights, to their tokens' rows of `sum`:
/// tokens in parallel, each token's outputs in order (so the sum is the one a single thread
/// makes).
pub fn add_weighted_rows<E: Real>(sum: &mut Mat<E>, outputs: &[WeightedRows<'_, E>]) {
    // Per token, the (output row, routing weight) of each expert it chose, in order.
    let mut per_token: Vec<Vec<(&[E], E)>> = vec![Vec::new(); sum.rows];
    for (rows, y) in outputs {
        for (r, &(s, w)) in rows.iter().enumerate() {
            per_token[s].push((y.row(r), w));
        }
    }
    let width = sum.cols.max(1);
    sum.data_mut()
        .par_chunks_mut(width)
        .zip(per_token)
        .for_each(|(row, chosen)| {
            for (y, w) in chosen {
                row.iter_mut().zip(y).for_each(|(o, &v)| *o += w * v);
            }
        });
}

/// `parts` added one after another in rank order, each sum held in the dtype.
pub fn sum_in_rank_order<B: Backend>(be: &B, parts: &[Mat<B::E>]) -> Result<Mat<B::E>> {
    let Some((first, rest)) = parts.split_first() else {
        bail!("all-reduce over no ranks");
    };
    rest.iter()
        .try_fold(first.clone(), |sum, p| be.add(&sum, p))
}

/// The CPU backend: `gemm` and the loops of [`ops`], in `E` at a precision.
#[derive(Clone, Copy, Debug)]
pub struct Cpu<E> {
    precision: Precision,
    number: PhantomData<E>,
}

impl Cpu<f32> {
    /// f32, or bf16/f16 emulated with f32 accumulation.
    pub fn new(precision: Precision) -> Self {
        Cpu {
            precision,
            number: PhantomData,
        }
    }
}

impl Cpu<f64> {
    pub fn f64() -> Self {
        Cpu {
            precision: Precision::F64,
            number: PhantomData,
        }
    }
}

impl<E: Real> Cpu<E> {
    fn round_in_place(&self, xs: &mut [E]) {
        if !matches!(self.precision, Precision::F32 | Precision::F64) {
            // A weight is millions of values: its parts in parallel (each value on its own).
            xs.par_chunks_mut(1 << 16)
                .for_each(|part| E::round_all(part, self.precision));
        }
    }

    fn rounded(&self, mut m: Mat<E>) -> Result<Mat<E>> {
        self.round(m.data_mut())?;
        Ok(m)
    }
}

impl<E: Real> Backend for Cpu<E> {
    type E = E;
    type Weight = HostWeight<E>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn hold(&self, w: Mat<f32>) -> Result<HostWeight<E>> {
        let (rows, cols) = (w.rows, w.cols);
        Ok(HostWeight::Values(Mat::new(
            rows,
            cols,
            self.hold_values(w.into_data()),
        )))
    }

    /// Quantized blocks stay blocks, decoded where a GEMM reads them; f32 values are read as
    /// they are.
    fn hold_stored(&self, w: &StoredBlock<'_>) -> Result<HostWeight<E>> {
        if w.ty() == GgmlType::F32 {
            return self.hold(w.dequantize()?);
        }
        Ok(HostWeight::Blocks(Blocks::read(w, self.precision)?))
    }

    fn hold_values(&self, v: Vec<f32>) -> Vec<E> {
        let mut v = E::widen_all(v);
        self.round_in_place(&mut v);
        v
    }

    fn hold_exact(&self, v: Vec<f32>) -> Vec<E> {
        E::widen_all(v)
    }

    fn linear(&self, x: &Mat<E>, w: &HostWeight<E>) -> Result<Mat<E>> {
        self.rounded(self.linear_exact(x, w)?)
    }

    /// [`host_linear::linear`]: `w · xᵀ` in parallel blocks of fixed size through the `gemm`
    /// crate, or the few-token kernel. Accumulates in `E`.
    fn linear_exact(&self, x: &Mat<E>, w: &HostWeight<E>) -> Result<Mat<E>> {
        host_linear::linear(x, w)
    }

    fn rms_norm(&self, x: &Mat<E>, w: &[E], eps: f64) -> Result<Mat<E>> {
        self.rounded(ops::rms_norm(x, w, eps))
    }

    fn layer_norm(&self, x: &Mat<E>, w: &[E], b: &[E], eps: f64) -> Result<Mat<E>> {
        self.rounded(ops::layer_norm(x, w, b, eps))
    }

    fn silu_mul(&self, gate: &Mat<E>, up: &Mat<E>) -> Result<Mat<E>> {
        self.rounded(ops::silu_mul(gate, up))
    }

    fn add(&self, a: &Mat<E>, b: &Mat<E>) -> Result<Mat<E>> {
        self.rounded(a.add(b))
    }

    fn round(&self, xs: &mut [E]) -> Result<()> {
        self.round_in_place(xs);
        Ok(())
    }

    fn reads_ahead(&self) -> bool {
        true
    }

    /// The CPU keeps a weight's blocks and decodes them for each use.
    fn kept_experts_join_any_group(&self) -> bool {
        false
    }

    fn claim_kept(&self, w: &HostWeight<E>) -> Result<Option<Claim>> {
        claim_host(w.bytes() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_columns_cut_each_head_and_refuse_cuts_past_a_head() {
        // Two rows of three heads of four values: 10·row + 4·head + column.
        let values: Vec<f32> = (0..2)
            .flat_map(|r| (0..12).map(move |c| (10 * r + c) as f32))
            .collect();
        let m = Mat::new(2, 12, values);
        let cut = |width, from, len| HeadCut { width, from, len };
        let got = head_columns_on_host(&m, cut(4, 1, 2)).unwrap();
        assert_eq!((got.rows, got.cols), (2, 6));
        let want = [
            1.0, 2.0, 5.0, 6.0, 9.0, 10.0, 11.0, 12.0, 15.0, 16.0, 19.0, 20.0,
        ];
        assert_eq!(got.data(), want);
        // One head of the whole row: a block of columns.
        let block = head_columns_on_host(&m, cut(12, 10, 2)).unwrap();
        assert_eq!(block.data(), [10.0, 11.0, 20.0, 21.0]);
        for bad in [cut(4, 3, 2), cut(5, 0, 1), cut(0, 0, 0)] {
            let err = head_columns_on_host(&m, bad).unwrap_err().to_string();
            assert!(err.contains("do not hold heads"), "{err}");
        }
        assert_eq!(head_columns_on_host(&m, cut(4, 4, 0)).unwrap().cols, 0);
    }
}
