//! The model's weights as the forward asks for them: canonical roles (whole `kv_b_proj`, one
//! expert at a time), dequantized to f32 from whatever layout the file has, only when asked.
//!
//! Beside it, the rest of weight access above the backends: a weight read only when a rank
//! needs it (`lazy_weight`), weights kept between passes (`kept`), and which slice each
//! tensor-parallel rank holds (`sharder`). How a file stores a weight and what memory may hold
//! it are below the backends, in [`crate::exec::storage`].

pub mod kept;
pub mod lazy_weight;
pub mod sharder;

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::exec::backend::Backend;
use crate::exec::faults::hooks::Hooks;
use crate::exec::faults::inject::Injection;
use crate::exec::mat::Mat;
use crate::exec::source::kept::{KeptWeights, Part};
use crate::exec::storage::stored::StoredMatrix;
use crate::model::kv_b::{assemble_kv_b, KvBDims};
use crate::model::names::{LayerWeight, WeightId};
use crate::model::schema::{detect_layout, ExpertForm, Family, KvBForm, Layout};
use crate::model::Glm5Config;
use crate::weights::quantize::round_trip;
use crate::weights::{quant, read_ahead, Encoding, GgmlType, ModelFiles};

/// Weights of one model file set with its config, and the fault planted in the run that reads
/// them (weight faults are applied here, op faults by the forward).
pub struct WeightSource {
    pub files: Arc<ModelFiles>,
    pub cfg: Glm5Config,
    layout: Layout,
    fault: Option<Injection>,
    /// Storage types of another file set each weight is passed through on load (see
    /// [`WeightSource::stored_as`]).
    storage: Option<HashMap<WeightId, GgmlType>>,
    /// Weights held for the run's later passes, when it has some ([`Self::keeping_weights`]).
    kept: Option<KeptWeights>,
}

impl WeightSource {
    pub fn new(files: impl Into<Arc<ModelFiles>>, cfg: Glm5Config, family: Family) -> Self {
        let files = files.into();
        let layout = detect_layout(family, files.tensors());
        WeightSource {
            files,
            cfg,
            layout,
            fault: None,
            storage: None,
            kept: None,
        }
    }

    /// This source keeping the weights it holds for a run's later passes (a generation, a
    /// warm-up), within the process's budget ([`crate::exec::source::kept`]).
    pub fn keeping_weights(self) -> Self {
        WeightSource {
            kept: Some(KeptWeights::default()),
            ..self
        }
    }

    /// `part` as `be` holds it, made by `hold` unless this source keeps it from an earlier
    /// pass.
    pub fn held<B: Backend>(
        &self,
        be: &B,
        part: Part,
        hold: impl FnOnce() -> Result<B::Weight>,
    ) -> Result<Arc<B::Weight>> {
        match &self.kept {
            Some(kept) => kept.get_or_hold(be, part, hold),
            None => hold().map(Arc::new),
        }
    }

    /// Whether this source keeps weight `id` whole as `be` holds it, from an earlier pass: a
    /// lookup, where making the weight's [`LazyWeight`](crate::exec::source::lazy_weight::LazyWeight) would
    /// find its tensor in the files first (a MoE layer asks for hundreds of experts' weights).
    pub fn keeps<B: Backend>(&self, be: &B, id: WeightId) -> bool {
        let whole = Part {
            id,
            rows: None,
            shard: None,
        };
        self.kept.as_ref().is_some_and(|kept| kept.has(be, whole))
    }

    /// This source with every weight quantized to the type `other` stores it as, and back:
    /// a run of it carries the quantization noise of a correct conversion to `other`'s files,
    /// the envelope such a conversion is judged against.
    pub fn stored_as(self, other: &WeightSource) -> Self {
        let family = other.layout.family;
        let types = other
            .files
            .tensors()
            .iter()
            .filter_map(|t| {
                let Encoding::Ggml(ty) = t.encoding else {
                    return None;
                };
                let id = match crate::model::schema::role(family, &t.name)? {
                    WeightId::Layer(l, LayerWeight::KB | LayerWeight::VB) => {
                        WeightId::Layer(l, LayerWeight::KvB)
                    }
                    WeightId::Expert { layer, which, .. } => WeightId::Layer(layer, which),
                    id => id,
                };
                Some((id, ty))
            })
            .collect();
        WeightSource {
            storage: Some(types),
            ..self
        }
    }

    /// How the files store `kv_b_proj` and the experts, and whose names they use.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The GGML type `id` is stored as (its first stored tensor's).
    pub fn storage_type(&self, id: WeightId) -> Option<GgmlType> {
        let name = self.tensor_names(id).into_iter().next()?;
        match self.files.get(&name)?.encoding {
            Encoding::Ggml(ty) => Some(ty),
            _ => None,
        }
    }

    /// `values` (rows of `row_len`) as the storage this source is passed through holds them.
    fn through_storage(&self, id: WeightId, values: Vec<f32>, row_len: usize) -> Result<Vec<f32>> {
        let ty = match (&self.storage, id) {
            (
                Some(types),
                WeightId::Layer(l, LayerWeight::ExpertsGate | LayerWeight::ExpertsUp),
            ) if !types.contains_key(&id) => {
                types.get(&WeightId::Layer(l, LayerWeight::ExpertsGateUp))
            }
            (Some(types), _) => types.get(&id),
            (None, _) => None,
        };
        match ty {
            Some(&ty) => Ok(round_trip(ty, values, row_len)?),
            None => Ok(values),
        }
    }

    /// This source as a candidate with `fault` planted.
    pub fn with_fault(self, fault: Option<Injection>) -> Self {
        WeightSource { fault, ..self }
    }

    pub fn fault(&self) -> Option<Injection> {
        self.fault
    }

    /// Where the planted fault reaches the run.
    pub fn hooks(&self) -> Hooks {
        Hooks::new(self.fault)
    }

    /// The stored tensors behind `id` (kv_b's split parts where the file splits it, each
    /// expert's tensor of a one-tensor-per-expert checkpoint).
    pub fn tensor_names(&self, id: WeightId) -> Vec<String> {
        match (id, self.layout.kv_b, self.layout.experts) {
            (WeightId::Layer(l, LayerWeight::KvB), KvBForm::Split | KvBForm::SplitFolded, _) => {
                vec![
                    self.name(WeightId::Layer(l, LayerWeight::KB)),
                    self.name(WeightId::Layer(l, LayerWeight::VB)),
                ]
            }
            (
                WeightId::Layer(l, LayerWeight::ExpertsGate | LayerWeight::ExpertsUp),
                _,
                ExpertForm::FusedGateUp,
            ) => vec![self.name(WeightId::Layer(l, LayerWeight::ExpertsGateUp))],
            (
                WeightId::Layer(
                    l,
                    which @ (LayerWeight::ExpertsGate
                    | LayerWeight::ExpertsUp
                    | LayerWeight::ExpertsDown),
                ),
                _,
                ExpertForm::PerExpert,
            ) => (0..self.cfg.n_routed_experts)
                .map(|expert| {
                    self.name(WeightId::Expert {
                        layer: l,
                        expert,
                        which,
                    })
                })
                .collect(),
            _ => vec![self.name(id)],
        }
        .into_iter()
        .filter(|n| self.files.get(n).is_some())
        .collect()
    }

    fn name(&self, id: WeightId) -> String {
        match self.layout.family {
            Family::Gguf => id.gguf_name(),
            Family::Hf => id.hf_name(),
        }
    }

    /// Dequantize rows of `name` (all when `None`) to f32, then give
    /// their mapped pages back: resident memory stays at the layer being computed, not at
    /// everything read so far.
    fn load_rows(
        &self,
        name: &str,
        rows: Option<std::ops::Range<u64>>,
    ) -> Result<(Vec<f32>, Vec<u64>)> {
        let t = self.files.require(name)?;
        let rows = rows.unwrap_or(0..t.rows());
        let data = if self.hooks().misreads_q4k() {
            self.files.dequantize_rows_with(
                t,
                rows.clone(),
                quant::dequantize_rows_misreading_q4k,
            )?
        } else {
            self.files.dequantize_rows(t, rows.clone())?
        };
        self.files.release_rows(t, rows);
        Ok((data, t.shape.clone()))
    }

    fn load(&self, name: &str) -> Result<(Vec<f32>, Vec<u64>)> {
        self.load_rows(name, None)
    }

    /// Rows `rows` of a matrix weight (embedding rows, a slice of lm_head), reading only those.
    pub fn matrix_rows(&self, id: WeightId, rows: std::ops::Range<u64>) -> Result<Mat> {
        let n = (rows.end - rows.start) as usize;
        if self.hooks().zeroes(id) {
            return Ok(Mat::zeros(n, self.cfg.hidden_size as usize));
        }
        let (data, shape) = self.load_rows(&self.name(id), Some(rows))?;
        let cols = *shape.last().unwrap_or(&1) as usize;
        Ok(Mat::new(n, cols, self.through_storage(id, data, cols)?))
    }

    /// Whether the file holds this weight (GGUF's `output.weight` is optional).
    pub fn has(&self, id: WeightId) -> bool {
        self.files.get(&self.name(id)).is_some()
    }

    /// A vector weight (norm, bias).
    pub fn vector(&self, id: WeightId) -> Result<Vec<f32>> {
        Ok(self.load(&self.name(id))?.0)
    }

    /// A vector weight as `be` holds it.
    pub fn vector_in<B: Backend>(&self, be: &B, id: WeightId) -> Result<Vec<B::E>> {
        Ok(be.hold_values(self.vector(id)?))
    }

    /// A matrix weight as `be` holds it: from its stored blocks where it can be read that way
    /// (see [`Self::stored_matrix`]), else dequantized here.
    pub fn matrix_in<B: Backend>(&self, be: &B, id: WeightId) -> Result<Arc<B::Weight>> {
        let part = Part {
            id,
            rows: None,
            shard: None,
        };
        self.held(be, part, || {
            if let Some(m) = self.stored_matrix(id) {
                return be.hold_stored(&m.whole());
            }
            if let WeightId::Layer(l, LayerWeight::KvB) = id {
                if let Some((k_b, v_b, d)) = self.stored_kv_b(l) {
                    return be.hold_kv_b(&k_b.whole(), &v_b.whole(), d);
                }
            }
            be.hold(self.matrix(id)?)
        })
    }

    /// Rows `rows` of a matrix weight as `be` holds them (a slice of lm_head).
    pub fn matrix_rows_in<B: Backend>(
        &self,
        be: &B,
        id: WeightId,
        rows: std::ops::Range<u64>,
    ) -> Result<Arc<B::Weight>> {
        let part = Part {
            id,
            rows: Some((rows.start, rows.end)),
            shard: None,
        };
        self.held(be, part, || {
            let block = self.stored_matrix(id).and_then(|m| {
                let cols = m.cols;
                m.block(rows.start as usize..rows.end as usize, 0..cols)
            });
            match block {
                Some(b) => be.hold_stored(&b),
                None => be.hold(self.matrix_rows(id, rows)?),
            }
        })
    }

    /// A matrix `[out, in]`; `kv_b_proj` is assembled from llama.cpp's split form if need be,
    /// a routed expert's read from its stacked tensor.
    pub fn matrix(&self, id: WeightId) -> Result<Mat> {
        if let WeightId::Expert {
            layer,
            expert,
            which,
        } = id
        {
            return self.expert_matrix(layer, expert, which);
        }
        if let (WeightId::Layer(l, LayerWeight::KvB), KvBForm::Split | KvBForm::SplitFolded) =
            (id, self.layout.kv_b)
        {
            let kv_b = self.assembled_kv_b(l)?;
            let (rows, cols) = (kv_b.rows, kv_b.cols);
            let stored = self.through_storage(id, kv_b.into_data(), cols)?;
            let w = Mat::new(rows, cols, stored);
            return Ok(self.hooks().rearranged(&self.cfg, id, w));
        }
        if id == WeightId::LmHead {
            return self.matrix_rows(id, 0..self.cfg.vocab_size);
        }
        let name = self.name(id);
        let (data, shape) = self.load(&name)?;
        let m = Mat::from_shape(data, &shape).with_context(|| name)?;
        let (rows, cols) = (m.rows, m.cols);
        let stored = Mat::new(rows, cols, self.through_storage(id, m.into_data(), cols)?);
        Ok(self.hooks().rearranged(&self.cfg, id, stored))
    }

    fn kv_b_dims(&self) -> KvBDims {
        let c = &self.cfg;
        KvBDims {
            heads: c.num_attention_heads as usize,
            kv_lora: c.kv_lora_rank as usize,
            nope: c.qk_nope_head_dim as usize,
            v: c.v_head_dim as usize,
        }
    }

    /// llama.cpp's split kv_b of layer `l` (`attn_k_b`, `attn_v_b`) as stored blocks, when a
    /// run may read it that way (as [`Self::stored_matrix`] says for a matrix): a GPU backend
    /// assembles kv_b from them on the device.
    pub fn stored_kv_b(&self, l: u64) -> Option<(StoredMatrix<'_>, StoredMatrix<'_>, KvBDims)> {
        let id = WeightId::Layer(l, LayerWeight::KvB);
        let split = matches!(self.layout.kv_b, KvBForm::Split | KvBForm::SplitFolded);
        if !split || self.storage.is_some() || self.hooks().changes_weight(id) {
            return None;
        }
        let d = self.kv_b_dims();
        let stored = |w, rows: usize| {
            let t = self.files.get(&self.name(WeightId::Layer(l, w)))?;
            // Exactly the split form's rows: any other shape goes to the host's assembly, which
            // names the tensor that does not fit.
            (t.rows() == rows as u64).then_some(())?;
            StoredMatrix::new(&self.files, t, 0, rows as u64)
        };
        let k_b = stored(LayerWeight::KB, d.heads * d.kv_lora)?;
        let v_b = stored(LayerWeight::VB, d.heads * d.v)?;
        (k_b.cols == d.nope && v_b.cols == d.kv_lora).then_some((k_b, v_b, d))
    }

    fn assembled_kv_b(&self, l: u64) -> Result<Mat> {
        let dims = self.kv_b_dims();
        let part = |w| self.load(&self.name(WeightId::Layer(l, w))).map(|(d, _)| d);
        let kv_b = assemble_kv_b(&part(LayerWeight::KB)?, &part(LayerWeight::VB)?, dims)
            .with_context(|| {
                let k_b = self.name(WeightId::Layer(l, LayerWeight::KB));
                match self.files.get(&k_b) {
                    Some(t) => format!("{}: {k_b}: shape", self.files.file_of(t).display()),
                    None => format!("layer {l} kv_b assembly"),
                }
            })?;
        Ok(Mat::new(
            dims.heads * (dims.nope + dims.v),
            dims.kv_lora,
            kv_b,
        ))
    }

    /// Routed expert `e` of layer `l`: its (gate, up, down) matrices, reading only that expert.
    pub fn expert(&self, l: u64, e: u64) -> Result<[Mat; 3]> {
        let one = |which| self.expert_matrix(l, e, which);
        Ok([
            one(LayerWeight::ExpertsGate)?,
            one(LayerWeight::ExpertsUp)?,
            one(LayerWeight::ExpertsDown)?,
        ])
    }

    /// `which` (`ExpertsGate`, `ExpertsUp` or `ExpertsDown`) of routed expert `e` of layer `l`,
    /// reading only its rows.
    pub fn expert_matrix(&self, l: u64, e: u64, which: LayerWeight) -> Result<Mat> {
        let (rows, cols) = self.expert_shape(which);
        let data = match self.expert_rows(l, e, which)? {
            Some((name, range)) => self.load_rows(&name, Some(range))?.0,
            None => self.vector(WeightId::Expert {
                layer: l,
                expert: e,
                which,
            })?,
        };
        if data.len() != rows * cols {
            bail!("layer {l} expert {e}: sizes do not match moe_intermediate_size × hidden ({rows} × {cols})");
        }
        let stored = self.through_storage(WeightId::Layer(l, which), data, cols)?;
        Ok(Mat::new(rows, cols, stored))
    }

    /// `[out, in]` of an expert's `which` matrix.
    fn expert_shape(&self, which: LayerWeight) -> (usize, usize) {
        let inter = self.cfg.moe_intermediate_size as usize;
        let h = self.cfg.hidden_size as usize;
        if which == LayerWeight::ExpertsDown {
            (h, inter)
        } else {
            (inter, h)
        }
    }

    /// The stacked tensor holding expert `e`'s `which` matrix and its rows there (gate before
    /// up in a fused gate_up tensor); `None` where each expert has tensors of its own.
    fn expert_rows(
        &self,
        l: u64,
        e: u64,
        which: LayerWeight,
    ) -> Result<Option<(String, std::ops::Range<u64>)>> {
        let inter = self.cfg.moe_intermediate_size;
        let (stacked, offset, rows) = match (self.layout.experts, which) {
            (ExpertForm::PerExpert, _) => return Ok(None),
            (ExpertForm::FusedGateUp, LayerWeight::ExpertsGate) => {
                (LayerWeight::ExpertsGateUp, 0, inter)
            }
            (ExpertForm::FusedGateUp, LayerWeight::ExpertsUp) => {
                (LayerWeight::ExpertsGateUp, inter, inter)
            }
            _ => (which, 0, 0),
        };
        let name = self.name(WeightId::Layer(l, stacked));
        let per_expert = self
            .files
            .require(&name)?
            .shape
            .get(1)
            .copied()
            .unwrap_or(0);
        let rows = if rows == 0 { per_expert } else { rows };
        let first = e * per_expert + offset;
        Ok(Some((name, first..first + rows)))
    }

    /// Asks for layer `l`'s routed `experts` to be read into the page cache ahead of their use,
    /// in the order a layer multiplies by them (see [`crate::weights::read_ahead`]).
    pub fn read_ahead_experts(&self, l: u64, experts: &[usize]) {
        let ranges = experts
            .iter()
            .flat_map(|&e| {
                [
                    LayerWeight::ExpertsGate,
                    LayerWeight::ExpertsUp,
                    LayerWeight::ExpertsDown,
                ]
                .map(|which| WeightId::Expert {
                    layer: l,
                    expert: e as u64,
                    which,
                })
            })
            .filter_map(|id| Some(self.stored_matrix(id)?.whole().file_range()))
            .collect();
        read_ahead::ask(ranges);
    }

    /// Where matrix `id` (a layer's weight, a routed expert's, lm_head) lies in the files as
    /// whole GGML blocks, when a run may read it that way: not through another file set's
    /// storage, not touched by a planted weight fault, and stored as one matrix (not as
    /// llama.cpp's split kv_b).
    pub fn stored_matrix(&self, id: WeightId) -> Option<StoredMatrix<'_>> {
        if self.storage.is_some() || self.hooks().changes_weight(id) {
            return None;
        }
        let (name, first, rows, expected) = match id {
            WeightId::Expert {
                layer,
                expert,
                which,
            } => {
                let shape = self.expert_shape(which);
                match self.expert_rows(layer, expert, which).ok()? {
                    Some((name, rows)) => (name, rows.start, rows.end - rows.start, Some(shape)),
                    None => (self.name(id), 0, shape.0 as u64, Some(shape)),
                }
            }
            WeightId::Layer(_, LayerWeight::KvB)
                if matches!(self.layout.kv_b, KvBForm::Split | KvBForm::SplitFolded) =>
            {
                return None
            }
            WeightId::Layer(..) | WeightId::LmHead => {
                let t = self.files.get(&self.name(id))?;
                let [rows, _] = t.shape[..] else {
                    return None;
                };
                (t.name.clone(), 0, rows, None)
            }
            _ => return None,
        };
        let t = self.files.get(&name)?;
        let m = StoredMatrix::new(&self.files, t, first, rows)?;
        match expected {
            Some(shape) if shape != (m.rows, m.cols) => None,
            _ => Some(m),
        }
    }
}
