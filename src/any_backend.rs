//! The backend a run picks at run time (`--backend cpu|cuda`): one type, so that a hybrid run can
//! put the CPU reference on one side of a layer and the GPUs on the other. It sits above both
//! backends ([`crate::exec`]'s CPU ops, [`crate::cuda`]), which know nothing of each other.

use anyhow::Result;

use crate::cuda::backend::{Cuda, GpuWeight};
use crate::cuda::memory::RankMemory;
use crate::cuda::ranks::ProcessRank;
use crate::dtype::Precision;
use crate::exec::backend::{Backend, Cpu, HeadCut, MlpJob, WeightedRows};
use crate::exec::cpu::host_weight::HostWeight;
use crate::exec::mat::Mat;
use crate::exec::ops::attention_core::AttentionInputs;
use crate::exec::ops::indexer_core::IndexerInputs;
use crate::exec::ops::rope::{Rope, RotateSpec};
use crate::exec::storage::claim::Claim;
use crate::exec::storage::stored::StoredBlock;
use crate::model::kv_b::KvBDims;

/// Where the candidate's ops run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// glmcheck's own CPU ops (bf16/f16 emulated with f32 accumulation), ranks as threads.
    #[default]
    Cpu,
    /// NVIDIA GPUs through CUDA: one GPU per tensor-parallel rank, cuBLAS GEMMs, NCCL
    /// all-reduce.
    Cuda,
}

impl BackendKind {
    pub const ALL: [BackendKind; 2] = [BackendKind::Cpu, BackendKind::Cuda];

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// A CPU or CUDA backend.
#[derive(Clone)]
pub enum AnyBackend {
    Cpu(Cpu<f32>),
    Cuda(Cuda),
}

/// A weight as either backend holds it.
pub enum AnyWeight {
    Cpu(HostWeight<f32>),
    Cuda(GpuWeight),
}

impl AnyWeight {
    fn on_cpu(&self) -> Result<&HostWeight<f32>> {
        match self {
            AnyWeight::Cpu(w) => Ok(w),
            AnyWeight::Cuda(_) => anyhow::bail!("a weight held on a GPU given to the CPU"),
        }
    }

    fn on_cuda(&self) -> Result<&GpuWeight> {
        match self {
            AnyWeight::Cuda(w) => Ok(w),
            AnyWeight::Cpu(_) => anyhow::bail!("a weight held on the CPU given to a GPU"),
        }
    }
}

/// MLP jobs with their weights as backend `W` holds them.
fn held_by<'a, W>(
    jobs: &[MlpJob<'a, AnyWeight>],
    held: impl Fn(&'a AnyWeight) -> Result<&'a W>,
) -> Result<Vec<MlpJob<'a, W>>> {
    jobs.iter()
        .map(|&(rows, [g, u, d])| Ok((rows, [held(g)?, held(u)?, held(d)?])))
        .collect()
}

impl AnyBackend {
    /// `kind` at `precision` (f32, bf16, f16) with `tp` ranks: all in this process, or on the
    /// GPUs only `process`'s rank.
    pub fn open(
        kind: BackendKind,
        precision: Precision,
        tp: usize,
        process: Option<&ProcessRank>,
    ) -> Result<AnyBackend> {
        Ok(match (kind, process) {
            (BackendKind::Cpu, _) => AnyBackend::Cpu(Cpu::new(precision)),
            (BackendKind::Cuda, None) => AnyBackend::Cuda(Cuda::open(precision, tp)?),
            (BackendKind::Cuda, Some(p)) => AnyBackend::Cuda(Cuda::open_rank(precision, p)?),
        })
    }

    /// On GPUs: sets aside `bytes` of each rank's memory budget for stored blocks (see
    /// [`Cuda::set_aside_for_blocks`]); the CPU has no such budget.
    pub fn set_aside_for_blocks(&self, bytes: u64) {
        if let AnyBackend::Cuda(c) = self {
            c.set_aside_for_blocks(bytes);
        }
    }

    /// How each rank used its GPU (none on the CPU).
    pub fn gpu_memory(&self) -> Vec<RankMemory> {
        match self {
            AnyBackend::Cpu(_) => Vec::new(),
            AnyBackend::Cuda(c) => c.memory(),
        }
    }
}

/// `$body` on the backend inside `$engine`, bound to `$be`.
macro_rules! on_backend {
    ($engine:expr, $be:ident => $body:expr) => {
        match $engine {
            AnyBackend::Cpu($be) => $body,
            AnyBackend::Cuda($be) => $body,
        }
    };
}

impl Backend for AnyBackend {
    type E = f32;
    type Weight = AnyWeight;

    fn name(&self) -> &'static str {
        on_backend!(self, be => be.name())
    }

    fn precision(&self) -> Precision {
        on_backend!(self, be => be.precision())
    }

    fn hold(&self, w: Mat<f32>) -> Result<AnyWeight> {
        Ok(match self {
            AnyBackend::Cpu(be) => AnyWeight::Cpu(be.hold(w)?),
            AnyBackend::Cuda(be) => AnyWeight::Cuda(be.hold(w)?),
        })
    }

    fn hold_stored(&self, w: &StoredBlock<'_>) -> Result<AnyWeight> {
        Ok(match self {
            AnyBackend::Cpu(be) => AnyWeight::Cpu(be.hold_stored(w)?),
            AnyBackend::Cuda(be) => AnyWeight::Cuda(be.hold_stored(w)?),
        })
    }

    fn hold_kv_b(
        &self,
        k_b: &StoredBlock<'_>,
        v_b: &StoredBlock<'_>,
        d: KvBDims,
    ) -> Result<AnyWeight> {
        Ok(match self {
            AnyBackend::Cpu(be) => AnyWeight::Cpu(be.hold_kv_b(k_b, v_b, d)?),
            AnyBackend::Cuda(be) => AnyWeight::Cuda(be.hold_kv_b(k_b, v_b, d)?),
        })
    }

    fn hold_values(&self, v: Vec<f32>) -> Vec<f32> {
        on_backend!(self, be => be.hold_values(v))
    }

    fn hold_exact(&self, v: Vec<f32>) -> Vec<f32> {
        on_backend!(self, be => be.hold_exact(v))
    }

    fn placed(&self, m: Mat<f32>) -> Result<Mat<f32>> {
        on_backend!(self, be => be.placed(m))
    }

    fn linear(&self, x: &Mat<f32>, w: &AnyWeight) -> Result<Mat<f32>> {
        match (self, w) {
            (AnyBackend::Cpu(be), AnyWeight::Cpu(w)) => be.linear(x, w),
            (AnyBackend::Cuda(be), AnyWeight::Cuda(w)) => be.linear(x, w),
            _ => anyhow::bail!("a weight held by one backend given to another"),
        }
    }

    fn linear_exact(&self, x: &Mat<f32>, w: &AnyWeight) -> Result<Mat<f32>> {
        match (self, w) {
            (AnyBackend::Cpu(be), AnyWeight::Cpu(w)) => be.linear_exact(x, w),
            (AnyBackend::Cuda(be), AnyWeight::Cuda(w)) => be.linear_exact(x, w),
            _ => anyhow::bail!("a weight held by one backend given to another"),
        }
    }

    fn rms_norm(&self, x: &Mat<f32>, w: &[f32], eps: f64) -> Result<Mat<f32>> {
        on_backend!(self, be => be.rms_norm(x, w, eps))
    }

    fn layer_norm(&self, x: &Mat<f32>, w: &[f32], b: &[f32], eps: f64) -> Result<Mat<f32>> {
        on_backend!(self, be => be.layer_norm(x, w, b, eps))
    }

    fn silu_mul(&self, gate: &Mat<f32>, up: &Mat<f32>) -> Result<Mat<f32>> {
        on_backend!(self, be => be.silu_mul(gate, up))
    }

    fn add(&self, a: &Mat<f32>, b: &Mat<f32>) -> Result<Mat<f32>> {
        on_backend!(self, be => be.add(a, b))
    }

    fn round(&self, xs: &mut [f32]) -> Result<()> {
        on_backend!(self, be => be.round(xs))
    }

    fn rounded(&self, m: Mat<f32>) -> Result<Mat<f32>> {
        on_backend!(self, be => be.rounded(m))
    }

    fn add_weighted(
        &self,
        sum: Option<Mat<f32>>,
        shape: (usize, usize),
        outputs: &[WeightedRows<'_, f32>],
    ) -> Result<Mat<f32>> {
        on_backend!(self, be => be.add_weighted(sum, shape, outputs))
    }

    fn rope(&self, m: &Mat<f32>, rope: &Rope<f32>, spec: RotateSpec) -> Result<Mat<f32>> {
        on_backend!(self, be => be.rope(m, rope, spec))
    }

    fn head_columns(&self, m: &Mat<f32>, cut: HeadCut) -> Result<Mat<f32>> {
        on_backend!(self, be => be.head_columns(m, cut))
    }

    fn attention(&self, a: &AttentionInputs<'_, f32>) -> Result<Mat<f32>> {
        on_backend!(self, be => be.attention(a))
    }

    fn indexer_scores(&self, a: &IndexerInputs<'_, f32>) -> Result<Mat<f32>> {
        on_backend!(self, be => be.indexer_scores(a))
    }

    fn mlp(
        &self,
        x: &Mat<f32>,
        gate: &AnyWeight,
        up: &AnyWeight,
        down: &AnyWeight,
    ) -> Result<Mat<f32>> {
        match self {
            AnyBackend::Cpu(be) => be.mlp(x, gate.on_cpu()?, up.on_cpu()?, down.on_cpu()?),
            AnyBackend::Cuda(be) => be.mlp(x, gate.on_cuda()?, up.on_cuda()?, down.on_cuda()?),
        }
    }

    fn mlps(&self, x: &Mat<f32>, jobs: &[MlpJob<'_, AnyWeight>]) -> Result<Vec<Mat<f32>>> {
        match self {
            AnyBackend::Cpu(be) => be.mlps(x, &held_by(jobs, AnyWeight::on_cpu)?),
            AnyBackend::Cuda(be) => be.mlps(x, &held_by(jobs, AnyWeight::on_cuda)?),
        }
    }

    fn experts_at_once(&self) -> usize {
        on_backend!(self, be => be.experts_at_once())
    }

    fn fuses_mlp(&self) -> bool {
        on_backend!(self, be => be.fuses_mlp())
    }

    fn kept_experts_join_any_group(&self) -> bool {
        on_backend!(self, be => be.kept_experts_join_any_group())
    }

    fn on_rank(&self, rank: usize) -> Self {
        match self {
            AnyBackend::Cpu(be) => AnyBackend::Cpu(be.on_rank(rank)),
            AnyBackend::Cuda(be) => AnyBackend::Cuda(be.on_rank(rank)),
        }
    }

    fn all_reduce(&self, parts: &[Mat<f32>]) -> Result<Mat<f32>> {
        on_backend!(self, be => be.all_reduce(parts))
    }

    fn collectives_across_processes(&self) -> bool {
        on_backend!(self, be => be.collectives_across_processes())
    }

    fn reads_ahead(&self) -> bool {
        on_backend!(self, be => be.reads_ahead())
    }

    fn claim_kept(&self, w: &AnyWeight) -> Result<Option<Claim>> {
        match (self, w) {
            (AnyBackend::Cpu(be), AnyWeight::Cpu(w)) => be.claim_kept(w),
            (AnyBackend::Cuda(be), AnyWeight::Cuda(w)) => be.claim_kept(w),
            _ => Ok(None),
        }
    }

    fn computes(&self, rank: usize) -> bool {
        on_backend!(self, be => be.computes(rank))
    }

    fn gather(&self, parts: Vec<Option<Mat<f32>>>) -> Result<Vec<Mat<f32>>> {
        on_backend!(self, be => be.gather(parts))
    }
}
