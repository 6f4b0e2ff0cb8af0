//! A matrix weight as the forward multiplies by it, read only when and as a rank needs it: its
//! rank's block of stored GGML blocks where the file allows (each rank reads its own shard,
//! and a GPU backend dequantizes it on the device), else the whole matrix dequantized on the
//! host once and cut into shards there.

use std::sync::Arc;

use anyhow::{anyhow, Result};
use once_cell::sync::OnceCell;

use crate::exec::backend::Backend;
use crate::exec::mat::Mat;
use crate::exec::source::kept::Part;
use crate::exec::source::sharder::Sharder;
use crate::exec::source::WeightSource;
use crate::exec::storage::stored::StoredMatrix;
use crate::model::kv_b::KvBDims;
use crate::model::names::{LayerWeight, WeightId};

pub struct LazyWeight<'a> {
    role: LayerWeight,
    /// Where its values come from (none for a matrix given whole, in tests).
    origin: Option<(&'a WeightSource, WeightId)>,
    stored: Option<StoredMatrix<'a>>,
    /// The whole matrix in f32, read once for the ranks that cannot take a stored block.
    host: OnceCell<Mat>,
}

impl<'a> LazyWeight<'a> {
    /// Layer `l`'s weight `role`.
    pub fn layer(src: &'a WeightSource, l: u64, role: LayerWeight) -> Self {
        Self::of(src, WeightId::Layer(l, role), role)
    }

    /// Routed expert `expert`'s `role` (`ExpertsGate`, `ExpertsUp` or `ExpertsDown`) in layer
    /// `l`.
    pub fn expert(src: &'a WeightSource, l: u64, expert: u64, role: LayerWeight) -> Self {
        let id = WeightId::Expert {
            layer: l,
            expert,
            which: role,
        };
        Self::of(src, id, role)
    }

    fn of(src: &'a WeightSource, id: WeightId, role: LayerWeight) -> Self {
        LazyWeight {
            role,
            origin: Some((src, id)),
            stored: src.stored_matrix(id),
            host: OnceCell::new(),
        }
    }

    /// A matrix already in memory, as the weight `role`.
    #[cfg(test)]
    pub fn given(role: LayerWeight, w: Mat) -> Self {
        LazyWeight {
            role,
            origin: None,
            stored: None,
            host: OnceCell::with_value(w),
        }
    }

    pub fn role(&self) -> LayerWeight {
        self.role
    }

    /// The whole matrix as `be` holds it (kept for later passes where the source keeps
    /// weights).
    pub fn held<B: Backend>(self, be: &B) -> Result<Arc<B::Weight>> {
        let LazyWeight {
            role,
            origin,
            stored,
            host,
        } = self;
        let hold = move || -> Result<B::Weight> {
            if let Some(m) = &stored {
                return be.hold_stored(&m.whole());
            }
            match (host.into_inner(), origin) {
                (Some(w), _) => be.hold(w),
                (None, Some((src, id))) => be.hold(src.matrix(id)?),
                (None, None) => Err(anyhow!("{role:?}: no values")),
            }
        };
        match origin {
            Some((src, id)) => src.held(be, Self::part(id, None), hold),
            None => hold().map(Arc::new),
        }
    }

    /// Rank `rank`'s shard as `be` holds it, the block `sharder` gives it.
    pub fn shard_held<B: Backend>(
        &self,
        be: &B,
        sharder: Sharder,
        rank: usize,
    ) -> Result<Arc<B::Weight>> {
        let hold = || -> Result<B::Weight> {
            if let Some(m) = &self.stored {
                let block = sharder.block(self.role, rank, m.rows, m.cols)?;
                if let Some(b) = block.and_then(|(rows, cols)| m.block(rows, cols)) {
                    return be.hold_stored(&b);
                }
            }
            if let Some(w) = self.split_kv_b_shard(be, sharder, rank)? {
                return Ok(w);
            }
            be.hold(sharder.shard(self.whole()?, self.role, rank)?)
        };
        match self.origin {
            Some((src, id)) => src.held(be, Self::part(id, Some((rank, sharder))), hold),
            None => hold().map(Arc::new),
        }
    }

    /// Rank `rank`'s heads of llama.cpp's split kv_b, from the blocks of those heads of
    /// `attn_k_b` and `attn_v_b`, where the file stores it so and the rank's rows are whole heads.
    fn split_kv_b_shard<B: Backend>(
        &self,
        be: &B,
        sharder: Sharder,
        rank: usize,
    ) -> Result<Option<B::Weight>> {
        let Some((src, WeightId::Layer(l, LayerWeight::KvB))) = self.origin else {
            return Ok(None);
        };
        let Some((k_b, v_b, d)) = src.stored_kv_b(l) else {
            return Ok(None);
        };
        let per_head = d.nope + d.v;
        let Some((rows, _)) = sharder.block(self.role, rank, d.heads * per_head, d.kv_lora)? else {
            return Ok(None);
        };
        if rows.start % per_head != 0 || rows.end % per_head != 0 {
            return Ok(None);
        }
        let heads = rows.start / per_head..rows.end / per_head;
        let k = k_b.block(heads.start * d.kv_lora..heads.end * d.kv_lora, 0..d.nope);
        let v = v_b.block(heads.start * d.v..heads.end * d.v, 0..d.kv_lora);
        let (Some(k), Some(v)) = (k, v) else {
            return Ok(None);
        };
        let d = KvBDims {
            heads: heads.len(),
            ..d
        };
        be.hold_kv_b(&k, &v, d).map(Some)
    }

    fn part(id: WeightId, shard: Option<(usize, Sharder)>) -> Part {
        Part {
            id,
            rows: None,
            shard: shard.map(|(rank, s)| (rank, s.tp, s.ep)),
        }
    }

    fn whole(&self) -> Result<&Mat> {
        self.host.get_or_try_init(|| match self.origin {
            Some((src, id)) => src.matrix(id),
            None => Err(anyhow!("{:?}: no values", self.role)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Precision;
    use crate::exec::backend::Cpu;
    use crate::pipeline::model::Model;
    use crate::synth::{Preset, SynthSpec};

    /// An expert's weight held through its lazy weight is kept under the id the MoE layer asks
    /// about when it groups kept experts (`WeightSource::keeps`), and only where the source
    /// keeps weights.
    #[test]
    fn an_expert_held_through_its_lazy_weight_is_kept_under_its_id() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        SynthSpec::new(Preset::Tiny.config(), 1)
            .write_gguf(&path)
            .unwrap();
        let model = Model::open(&path).unwrap();
        let be = Cpu::new(Precision::F32);
        let id = |which| WeightId::Expert {
            layer: 1,
            expert: 3,
            which,
        };
        let keeping = model.source().keeping_weights();
        assert!(!keeping.keeps(&be, id(LayerWeight::ExpertsGate)));
        LazyWeight::expert(&keeping, 1, 3, LayerWeight::ExpertsGate)
            .held(&be)
            .unwrap();
        assert!(keeping.keeps(&be, id(LayerWeight::ExpertsGate)));
        assert!(!keeping.keeps(&be, id(LayerWeight::ExpertsUp)));
        let plain = model.source();
        LazyWeight::expert(&plain, 1, 3, LayerWeight::ExpertsGate)
            .held(&be)
            .unwrap();
        assert!(!plain.keeps(&be, id(LayerWeight::ExpertsGate)));
    }
}
