//! The CUDA backend: the ops of [`Backend`] on NVIDIA GPUs, one GPU per tensor-parallel rank.
//! Each rank keeps its shards' stored GGML blocks on its GPU after their first use and
//! dequantizes a weight there into the run's dtype (f32, bf16 or f16) for the op that multiplies
//! by it, freeing that copy after (llama.cpp's split kv_b is assembled there from its two
//! tensors' blocks); GEMMs go through cuBLAS with f32 accumulation, norms and element-wise ops
//! through `kernels/ops.cu`, and the
//! all-reduce of a TP run through NCCL across the ranks' GPUs. Activations travel as host
//! matrices between ops, so the same forward and shard plan drive the CPU and the GPUs, and each
//! op can be checked against the CPU's (`glmcheck selftest`); an op's output also stays on its
//! GPU as the matrix's twin ([`crate::exec::mat::Mat::with_twin`]), which the next op there
//! reads instead of an upload.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use anyhow::{anyhow, bail, Result};
use half::{bf16, f16};
use rayon::prelude::*;

use super::device::Device;
use super::dtype::{Dtype, Held};
use super::launch::GpuMlp;
use super::memory::{Buffer, RankMemory};
use super::ranks::{lock, ProcessRank, Ranks};
use super::DequantOutput;
use crate::dtype::Precision;
use crate::exec::backend::{
    all_computed, head_columns_on_host, kv_b_on_host, sum_in_rank_order, weighted_on_host, Backend,
    HeadCut, MlpJob, WeightedRows,
};
use crate::exec::mat::Mat;
use crate::exec::ops::attention_core::AttentionInputs;
use crate::exec::ops::indexer_core::{indexer_scores_core, IndexerInputs};
use crate::exec::ops::rope::{Rope, RotateSpec};
use crate::exec::storage::claim::Claim;
use crate::exec::storage::stored::StoredBlock;
use crate::model::kv_b::KvBDims;

/// Values per parallel task of the host's rounding.
const ROUND_CHUNK: usize = 1 << 14;

/// Routed experts dequantized and run in one GPU trip: their dequantized weights take 16 times
/// an expert's (1.2 GB in bf16 at GLM-5's widths, 2.4 GB in f32), and 256 experts go in 16
/// trips. Experts whose dequantized weights a run keeps do not count.
const EXPERTS_PER_TRIP: usize = 16;

/// `$body` with the type `$D` standing for the dtype of precision `$p`.
macro_rules! with_dtype {
    ($p:expr, $D:ident => $body:expr) => {
        match $p {
            Precision::Bf16 => {
                type $D = bf16;
                $body
            }
            Precision::F16 => {
                type $D = f16;
                $body
            }
            Precision::F32 | Precision::F64 => {
                type $D = f32;
                $body
            }
        }
    };
}

/// The CUDA backend as one rank runs it.
#[derive(Clone)]
pub struct Cuda {
    pub(super) ranks: Arc<Ranks>,
    pub(super) rank: usize,
    pub(super) precision: Precision,
}

/// A weight on a rank's GPU.
pub struct GpuWeight {
    rank: usize,
    rows: usize,
    cols: usize,
    data: Held,
}

impl Cuda {
    /// GPUs 0..`tp`, one per rank, at `precision` (f32, bf16 or f16).
    pub fn open(precision: Precision, tp: usize) -> Result<Cuda> {
        Ok(Cuda::over(Ranks::open(precision, tp)?, precision))
    }

    /// Rank `p.rank` of `p.world_size` in a process of its own, on GPU `rank` (modulo the GPUs
    /// visible), joined to the others through the NCCL id in `p.nccl_id` — the route to
    /// several nodes.
    pub fn open_rank(precision: Precision, p: &ProcessRank) -> Result<Cuda> {
        Ok(Cuda::over(Ranks::open_rank(precision, p)?, precision))
    }

    fn over(ranks: Ranks, precision: Precision) -> Cuda {
        Cuda {
            ranks: Arc::new(ranks),
            rank: 0,
            precision,
        }
    }

    /// The same GPUs (their kept blocks and memory budget shared) at another precision, from
    /// rank 0: a hybrid run's f32 reference beside a candidate on them.
    pub fn at_precision(&self, precision: Precision) -> Cuda {
        Cuda {
            ranks: self.ranks.clone(),
            rank: 0,
            precision,
        }
    }

    /// This rank's device, bound to the calling thread.
    fn device(&self, rank: usize) -> Result<MutexGuard<'_, Device>> {
        self.ranks.device(rank)
    }

    /// The GPUs' names, by rank.
    pub fn device_names(&self) -> Vec<String> {
        self.ranks
            .devices
            .iter()
            .map(|d| lock(d).gpu.name.clone())
            .collect()
    }

    /// Sets aside `bytes` of each rank's budget for stored blocks (its share of the model's
    /// stored bytes): dequantized weights a run keeps for later passes take only the rest.
    pub fn set_aside_for_blocks(&self, bytes: u64) {
        for d in &self.ranks.devices {
            lock(d).resident.for_blocks = bytes;
        }
    }

    /// How each local rank used its GPU so far.
    pub fn memory(&self) -> Vec<RankMemory> {
        self.ranks
            .devices
            .iter()
            .map(|d| {
                let d = lock(d);
                RankMemory {
                    peak_bytes: d.meter.peak.load(Ordering::Relaxed),
                    resident_bytes: d.resident.kept,
                    kept_weight_bytes: d.resident.weights.load(Ordering::Relaxed),
                    loaded_bytes: d.resident.loaded,
                    load_seconds: d.resident.load_seconds,
                }
            })
            .collect()
    }
}

impl Backend for Cuda {
    type E = f32;
    type Weight = GpuWeight;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn hold(&self, w: Mat<f32>) -> Result<GpuWeight> {
        let device = self.device(self.rank)?;
        let data = with_dtype!(self.precision, D => D::held(device.upload_weight::<D>(w.data())?));
        Ok(GpuWeight {
            rank: self.rank,
            rows: w.rows,
            cols: w.cols,
            data,
        })
    }

    /// Dequantized on this rank's GPU, from blocks kept there where it can.
    fn hold_stored(&self, w: &StoredBlock<'_>) -> Result<GpuWeight> {
        let mut device = self.device(self.rank)?;
        if !device.gpu.dequantizes(w.ty()) {
            drop(device);
            return self.hold(w.dequantize()?);
        }
        let data = with_dtype!(self.precision, D => D::held(device.dequantize_stored::<D>(w)?));
        let (rows, cols) = w.shape();
        Ok(GpuWeight {
            rank: self.rank,
            rows,
            cols,
            data,
        })
    }

    /// Assembled on this rank's GPU from the two tensors' blocks, dequantized there (and kept
    /// there as blocks, within the budget), so that no pass assembles it on the host.
    fn hold_kv_b(
        &self,
        k_b: &StoredBlock<'_>,
        v_b: &StoredBlock<'_>,
        d: KvBDims,
    ) -> Result<GpuWeight> {
        let mut device = self.device(self.rank)?;
        if !(device.gpu.dequantizes(k_b.ty()) && device.gpu.dequantizes(v_b.ty())) {
            drop(device);
            return self.hold(kv_b_on_host(k_b, v_b, d)?);
        }
        let (k, v) = (
            device.dequantize_stored::<f32>(k_b)?,
            device.dequantize_stored::<f32>(v_b)?,
        );
        let data = with_dtype!(self.precision, D => D::held(device.assemble_kv_b::<D>(&k, &v, d)?));
        Ok(GpuWeight {
            rank: self.rank,
            rows: d.heads * (d.nope + d.v),
            cols: d.kv_lora,
            data,
        })
    }

    fn hold_values(&self, v: Vec<f32>) -> Vec<f32> {
        with_dtype!(self.precision, D => v.into_iter().map(|x| D::from_f32(x).to_f32()).collect())
    }

    fn hold_exact(&self, v: Vec<f32>) -> Vec<f32> {
        v
    }

    /// Uploaded once, as the dtype, and left beside the host's values.
    fn placed(&self, m: Mat<f32>) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.placed::<D>(m))
    }

    fn linear(&self, x: &Mat<f32>, w: &GpuWeight) -> Result<Mat<f32>> {
        self.linear_as(x, w, false)
    }

    fn linear_exact(&self, x: &Mat<f32>, w: &GpuWeight) -> Result<Mat<f32>> {
        self.linear_as(x, w, true)
    }

    fn rms_norm(&self, x: &Mat<f32>, w: &[f32], eps: f64) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.norm::<D>(x, w, None, eps))
    }

    fn layer_norm(&self, x: &Mat<f32>, w: &[f32], b: &[f32], eps: f64) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.norm::<D>(x, w, Some(b), eps))
    }

    fn silu_mul(&self, gate: &Mat<f32>, up: &Mat<f32>) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.elementwise::<D>("silu_mul", gate, up))
    }

    fn add(&self, a: &Mat<f32>, b: &Mat<f32>) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.elementwise::<D>("add", a, b))
    }

    /// On the host, in parallel: activations are host matrices between ops, so a trip to the
    /// GPU and back would only add two copies (the host's rounding to nearest even is the GPU
    /// kernels' `store`, bit for bit, NaN payloads aside).
    fn round(&self, xs: &mut [f32]) -> Result<()> {
        with_dtype!(self.precision, D => xs
            .par_chunks_mut(ROUND_CHUNK)
            .for_each(|c| c.iter_mut().for_each(|x| *x = D::from_f32(*x).to_f32())));
        Ok(())
    }

    /// On the GPU where it holds `m` in f32 and runs alone (a routed sum left there), else on
    /// the host.
    fn rounded(&self, m: Mat<f32>) -> Result<Mat<f32>> {
        if matches!(self.precision, Precision::F32 | Precision::F64) {
            return Ok(m);
        }
        let device = self.device(self.rank)?;
        if let Some(r) = with_dtype!(self.precision, D => device.rounded::<D>(&m))? {
            return Ok(r);
        }
        drop(device);
        let mut m = m;
        self.round(m.data_mut())?;
        Ok(m)
    }

    /// On the GPU where it holds the outputs (and the sum so far) and runs alone, else on the
    /// host.
    fn add_weighted(
        &self,
        sum: Option<Mat<f32>>,
        shape: (usize, usize),
        outputs: &[WeightedRows<'_, f32>],
    ) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        let on_gpu = with_dtype!(self.precision, D => device.add_weighted::<D>(sum.as_ref(), shape, outputs))?;
        drop(device);
        Ok(on_gpu.unwrap_or_else(|| weighted_on_host(sum, shape, outputs)))
    }

    fn rope(&self, m: &Mat<f32>, rope: &Rope<f32>, spec: RotateSpec) -> Result<Mat<f32>> {
        self.device(self.rank)?.rope(m, rope, spec)
    }

    /// On the GPU where the rows are held there (in f32, as RoPE leaves them, or in the run's
    /// dtype), else on the host.
    fn head_columns(&self, m: &Mat<f32>, cut: HeadCut) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        let here = match device.head_columns::<f32>(m, cut)? {
            Some(columns) => Some(columns),
            None => with_dtype!(self.precision, D => device.head_columns::<D>(m, cut))?,
        };
        drop(device);
        match here {
            Some(columns) => Ok(columns),
            None => head_columns_on_host(m, cut),
        }
    }

    fn attention(&self, a: &AttentionInputs<'_, f32>) -> Result<Mat<f32>> {
        let device = self.device(self.rank)?;
        with_dtype!(self.precision, D => device.attention::<D>(a))
    }

    /// On the GPU; on the host where a query's heads do not fit in a block's shared memory
    /// (the GPU free meanwhile).
    fn indexer_scores(&self, a: &IndexerInputs<'_, f32>) -> Result<Mat<f32>> {
        let on_gpu = self.device(self.rank)?.indexer_scores(a)?;
        Ok(on_gpu.unwrap_or_else(|| Mat::new(a.q.rows, a.positions(), indexer_scores_core(a))))
    }

    /// The three GEMMs and SiLU·up on the weights' GPU, the input read from its twin or sent
    /// once, the output fetched once and left there as its twin.
    fn mlp(
        &self,
        x: &Mat<f32>,
        gate: &GpuWeight,
        up: &GpuWeight,
        down: &GpuWeight,
    ) -> Result<Mat<f32>> {
        let mut one = self.mlps_on_rows(x, &[(None, [gate, up, down])])?;
        Ok(one.remove(0))
    }

    /// Every expert of the group on its weights' GPU in one trip: `x` read from its twin or
    /// sent once, each expert's rows picked out there, all outputs fetched in one copy (256
    /// trips a layer were most of a MoE layer's time).
    fn mlps(&self, x: &Mat<f32>, jobs: &[MlpJob<'_, GpuWeight>]) -> Result<Vec<Mat<f32>>> {
        let jobs: Vec<_> = jobs.iter().map(|&(rows, w)| (Some(rows), w)).collect();
        self.mlps_on_rows(x, &jobs)
    }

    fn experts_at_once(&self) -> usize {
        EXPERTS_PER_TRIP
    }

    /// Kept weights are dequantized already: a layer's experts kept from the warm-up pass go in
    /// as few trips as their routed rows allow (one at 512 tokens).
    fn kept_experts_join_any_group(&self) -> bool {
        true
    }

    fn fuses_mlp(&self) -> bool {
        true
    }

    /// On the weight's GPU, beside its blocks, within the room they leave.
    fn claim_kept(&self, w: &GpuWeight) -> Result<Option<Claim>> {
        Ok(self.device(w.rank)?.resident.claim_weight(w.data.bytes()))
    }

    fn on_rank(&self, rank: usize) -> Self {
        Cuda {
            rank: rank % self.ranks.devices.len(),
            ..self.clone()
        }
    }

    fn computes(&self, rank: usize) -> bool {
        self.ranks.local.contains(&rank)
    }

    fn collectives_across_processes(&self) -> bool {
        self.ranks.local.len() < self.ranks.tp
    }

    fn gather(&self, parts: Vec<Option<Mat<f32>>>) -> Result<Vec<Mat<f32>>> {
        let ranks = &self.ranks;
        match (&ranks.comms, ranks.local.as_slice()) {
            (Some(comms), &[own]) if ranks.tp > 1 && parts.len() == ranks.tp => {
                let Some(Some(mine)) = parts.get(own) else {
                    bail!("rank {own}'s own part is missing");
                };
                let comms = lock(comms);
                with_dtype!(self.precision, D => self.ranks.nccl_gather::<D>(&comms, mine))
            }
            _ => all_computed(parts),
        }
    }

    /// NCCL across the ranks' GPUs (or processes) when there is one part per rank.
    fn all_reduce(&self, parts: &[Mat<f32>]) -> Result<Mat<f32>> {
        let shapes_agree = parts
            .iter()
            .all(|p| (p.rows, p.cols) == (parts[0].rows, parts[0].cols));
        match &self.ranks.comms {
            Some(comms) if parts.len() == self.ranks.tp && shapes_agree => {
                let comms = lock(comms);
                with_dtype!(self.precision, D => self.ranks.nccl_all_reduce::<D>(&comms, parts))
            }
            _ => sum_in_rank_order(self, parts),
        }
    }
}

impl Cuda {
    /// Gated MLPs on rows of `x` (all of them where `None`), on the first one's rank.
    fn mlps_on_rows(
        &self,
        x: &Mat<f32>,
        jobs: &[(Option<&[usize]>, [&GpuWeight; 3])],
    ) -> Result<Vec<Mat<f32>>> {
        let Some((_, [first, ..])) = jobs.first() else {
            return Ok(Vec::new());
        };
        for (rows, [gate, up, down]) in jobs {
            check_mlp(x, *rows, gate, up, down)?;
            if [gate.rank, up.rank, down.rank] != [first.rank; 3] {
                bail!(
                    "mlp: weights on ranks {}, {} and {} in a group on rank {}",
                    gate.rank,
                    up.rank,
                    down.rank,
                    first.rank
                );
            }
        }
        let device = self.device(first.rank)?;
        with_dtype!(self.precision, D => {
            let jobs = jobs
                .iter()
                .map(|&(rows, [gate, up, down])| {
                    Ok(GpuMlp {
                        rows,
                        weights: [buffer::<D>(gate)?, buffer::<D>(up)?, buffer::<D>(down)?],
                        inner: gate.rows,
                        out_rows: down.rows,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            device.mlps(x, &jobs)
        })
    }

    fn linear_as(&self, x: &Mat<f32>, w: &GpuWeight, exact: bool) -> Result<Mat<f32>> {
        if x.cols != w.cols {
            bail!(
                "linear: input has {} features, weight expects {}",
                x.cols,
                w.cols
            );
        }
        let device = self.device(w.rank)?;
        match &w.data {
            Held::F32(b) => device.linear(x, b, w.rows, exact),
            Held::Bf16(b) => device.linear(x, b, w.rows, exact),
            Held::F16(b) => device.linear(x, b, w.rows, exact),
        }
    }
}

/// A gated MLP's input and weights agree in shape: `x` of `gate`'s columns, `up` as `gate`,
/// `down` from `gate`'s rows; its rows are rows of `x`.
fn check_mlp(
    x: &Mat<f32>,
    rows: Option<&[usize]>,
    gate: &GpuWeight,
    up: &GpuWeight,
    down: &GpuWeight,
) -> Result<()> {
    if let Some(r) = rows.and_then(|rows| rows.iter().find(|&&r| r >= x.rows)) {
        bail!("mlp: row {r} of an input of {} rows", x.rows);
    }
    if x.cols != gate.cols || (up.rows, up.cols) != (gate.rows, gate.cols) || down.cols != gate.rows
    {
        bail!(
            "mlp: input of {} features, gate {}×{}, up {}×{}, down {}×{}",
            x.cols,
            gate.rows,
            gate.cols,
            up.rows,
            up.cols,
            down.rows,
            down.cols
        );
    }
    Ok(())
}

/// A held weight's buffer in dtype `D`, the run's.
fn buffer<D: Dtype>(w: &GpuWeight) -> Result<&Buffer<D>> {
    D::of(&w.data).ok_or_else(|| anyhow!("mlp: a weight held in another dtype than the run's"))
}
