//! The values of a synthetic GLM-5's weights, designed so that the model means something.
//!
//! * Residual-dominant: every sublayer's output is about 0.3 of the residual stream's scale
//!   (output projections have gain 0.3, inputs unit gain), so activations stay finite and well
//!   scaled at any depth, while every layer still moves the stream enough for a broken layer to
//!   show.
//! * Peaked logits on a next-token pattern: `lm_head` row j is `γ/H · Σ embed[t]` over the tokens
//!   t whose next token is j, with γ = 2 ln V + 8. The final hidden state stays close to its
//!   token's embedding, so the pattern's token wins by a wide margin (entropy far below ln V).
//! * The fp16-overflow knob ([`Massive`]): one residual channel (channel 0, which embeddings set
//!   to 1 and no other weight reads or writes) is driven to about 1.1·10⁵ by one neuron of layer
//!   L's dense MLP or shared expert — past fp16's 65504, within reach of vLLM's 1/2.5 residual
//!   rescaling. The RMSNorms after it scale the other channels up by the same factor, so in
//!   f32 the model predicts exactly as before; in fp16 the residual stream overflows at layer L.
//!   (Real LLMs have such "massive activations"; this one is made on purpose.)
//!
//! Every row has its own random stream (`SplitMix::for_row`) keyed by the weight's canonical
//! (Hugging Face, stacked-expert) name, so the GGUF and HF forms of one seed hold the same values
//! and rows can be made in any order.

use std::ops::Range;

use crate::model::names::{LayerWeight, LayerWeight::*, WeightId};
use crate::model::Glm5Config;

use super::rng::SplitMix;

/// Gain of the projections that write into the residual stream.
const OUTPUT_GAIN: f32 = 0.3;
/// The residual channel the fp16-overflow knob drives.
const MASSIVE_CHANNEL: usize = 0;
/// Its value in every embedding row, so a layer can amplify it.
const MASSIVE_BASE: f32 = 1.0;
/// Gate and up weight of the amplifying neuron on that channel.
const MASSIVE_GAIN: f32 = 4.0;

/// Drive the residual stream past the fp16 range at `layer`'s FFN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Massive {
    pub layer: u64,
    /// Target value of the massive channel after `layer` (default 1.1·10⁵).
    pub value: f32,
}

impl Massive {
    pub const DEFAULT_VALUE: f32 = 1.1e5;
}

/// Makes the rows of every canonical weight.
pub struct WeightGen {
    cfg: Glm5Config,
    seed: u64,
    massive: Option<Massive>,
    /// For lm_head row j, the tokens whose next token is j (CSR: `starts[j]..starts[j+1]`).
    pre_starts: Vec<usize>,
    pre_tokens: Vec<u32>,
}

impl WeightGen {
    /// `next_token[t]` is the token the model should predict after `t`.
    pub fn new(cfg: &Glm5Config, seed: u64, massive: Option<Massive>, next_token: &[u32]) -> Self {
        let v = cfg.vocab_size as usize;
        let mut counts = vec![0usize; v + 1];
        for &j in next_token {
            counts[j as usize + 1] += 1;
        }
        for j in 0..v {
            counts[j + 1] += counts[j];
        }
        let mut fill = counts.clone();
        let mut pre_tokens = vec![0u32; next_token.len()];
        for (t, &j) in next_token.iter().enumerate() {
            pre_tokens[fill[j as usize]] = t as u32;
            fill[j as usize] += 1;
        }
        WeightGen {
            cfg: cfg.clone(),
            seed,
            massive,
            pre_starts: counts,
            pre_tokens,
        }
    }

    /// Rows `rows` of canonical weight `id` of row-major `shape` (stacked experts `[E, out, in]`,
    /// whole `kv_b_proj`), flattened.
    pub fn rows(&self, id: WeightId, shape: &[u64], rows: Range<u64>) -> Vec<f32> {
        let row_len = *shape.last().unwrap_or(&1) as usize;
        let key = id.hf_name();
        let mut out = vec![0f32; (rows.end - rows.start) as usize * row_len];
        for (r, row) in rows.clone().zip(out.chunks_exact_mut(row_len)) {
            let mut rng = SplitMix::for_row(self.seed, &key, r);
            match id {
                WeightId::Embed => self.embed_row(&mut rng, row),
                WeightId::LmHead => self.lm_head_row(r, row),
                WeightId::FinalNorm => self.norm_row(&mut rng, row, self.massive.is_some()),
                WeightId::Layer(l, w) => self.layer_row(&mut rng, l, w, shape, r, row),
                WeightId::Expert { .. } => unreachable!("experts are generated stacked"),
            }
        }
        out
    }

    fn embed_row(&self, rng: &mut SplitMix, row: &mut [f32]) {
        row.iter_mut().for_each(|x| *x = rng.normal());
        if self.massive.is_some() {
            row[MASSIVE_CHANNEL] = MASSIVE_BASE;
        }
    }

    fn lm_head_row(&self, j: u64, row: &mut [f32]) {
        let h = row.len();
        let gamma = 2.0 * (self.cfg.vocab_size as f32).ln() + 8.0;
        let tokens = &self.pre_tokens[self.pre_starts[j as usize]..self.pre_starts[j as usize + 1]];
        if tokens.is_empty() {
            // Not a pattern target: small random logits.
            let mut rng = SplitMix::for_row(self.seed, "lm_head.unused", j);
            row.iter_mut()
                .for_each(|x| *x = 0.5 * rng.normal() / (h as f32).sqrt());
        }
        let mut e = vec![0f32; h];
        for &t in tokens {
            self.embed_row(
                &mut SplitMix::for_row(self.seed, &WeightId::Embed.hf_name(), u64::from(t)),
                &mut e,
            );
            row.iter_mut()
                .zip(&e)
                .for_each(|(x, v)| *x += gamma / h as f32 * v);
        }
        if self.massive.is_some() {
            row[MASSIVE_CHANNEL] = 0.0;
        }
    }

    /// RMSNorm weights near 1; after the massive layer, the residual norms undo the massive
    /// channel's share of the RMS so the other channels keep their scale.
    fn norm_row(&self, rng: &mut SplitMix, row: &mut [f32], after_massive: bool) {
        row.iter_mut().for_each(|x| *x = 1.0 + 0.1 * rng.normal());
        if let (true, Some(m)) = (after_massive, self.massive) {
            let rescale = m.value / (row.len() as f32).sqrt();
            row.iter_mut().for_each(|x| *x *= rescale);
            row[MASSIVE_CHANNEL] = 1.0 / (row.len() as f32).sqrt();
        }
    }

    fn layer_row(
        &self,
        rng: &mut SplitMix,
        l: u64,
        w: LayerWeight,
        shape: &[u64],
        r: u64,
        row: &mut [f32],
    ) {
        match w {
            // The norms that read the residual stream.
            AttnNorm | FfnNorm | NextnHnorm => {
                self.norm_row(rng, row, self.massive.is_some_and(|m| l > m.layer))
            }
            QANorm | KvANorm | IndexerKNorm | NextnEnorm | NextnSharedHeadNorm => {
                self.norm_row(rng, row, false)
            }
            IndexerKNormBias | RouterBias => row.iter_mut().for_each(|x| *x = 0.1 * rng.normal()),
            _ => self.matrix_row(rng, l, w, shape, r, row),
        }
    }

    fn matrix_row(
        &self,
        rng: &mut SplitMix,
        l: u64,
        w: LayerWeight,
        shape: &[u64],
        r: u64,
        row: &mut [f32],
    ) {
        let fan_in = row.len() as f32;
        let writes_residual = matches!(w, AttnOut | Down | SharedDown | ExpertsDown);
        let gain = if writes_residual { OUTPUT_GAIN } else { 1.0 };
        row.iter_mut()
            .for_each(|x| *x = gain * rng.normal() / fan_in.sqrt());
        let Some(m) = self.massive else { return };
        let out_rows = shape[shape.len() - 2];
        let out_index = r % out_rows;
        let reads_residual = matches!(
            w,
            QA | KvA
                | Gate
                | Up
                | SharedGate
                | SharedUp
                | ExpertsGate
                | ExpertsUp
                | Router
                | IndexerK
                | IndexerProj
        );
        if reads_residual {
            row[MASSIVE_CHANNEL] = 0.0;
        }
        if writes_residual && out_index == MASSIVE_CHANNEL as u64 {
            row.iter_mut().for_each(|x| *x = 0.0);
        }
        if l != m.layer {
            return;
        }
        // The amplifying neuron (intermediate index 0) of layer L's dense MLP or shared expert.
        let amplifier = if self.cfg.is_moe_layer(l) {
            [SharedGate, SharedUp, SharedDown]
        } else {
            [Gate, Up, Down]
        };
        if (w == amplifier[0] || w == amplifier[1]) && out_index == 0 {
            row.iter_mut().for_each(|x| *x = 0.0);
            row[MASSIVE_CHANNEL] = MASSIVE_GAIN;
        } else if w == amplifier[2] {
            row[0] = 0.0;
            if out_index == MASSIVE_CHANNEL as u64 {
                // silu(g·h)·(u·h) with h ≈ 1 on the massive channel.
                let act = silu(MASSIVE_GAIN) * MASSIVE_GAIN;
                row[0] = m.value / act;
            }
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Check that the knob can work on this config: the layer exists and has a dense MLP or a
/// shared expert to hold the amplifying neuron.
pub fn check_massive(cfg: &Glm5Config, m: &Massive) -> Result<(), String> {
    if m.layer >= cfg.num_hidden_layers {
        return Err(format!(
            "fp16-overflow layer {} is not below num_hidden_layers {}",
            m.layer, cfg.num_hidden_layers
        ));
    }
    if cfg.is_moe_layer(m.layer) && cfg.n_shared_experts == 0 {
        return Err(format!(
            "fp16-overflow layer {} is a MoE layer without a shared expert",
            m.layer
        ));
    }
    if !(m.value > 65504.0 && m.value.is_finite()) {
        return Err(format!(
            "fp16-overflow value {} must exceed fp16's 65504",
            m.value
        ));
    }
    Ok(())
}
