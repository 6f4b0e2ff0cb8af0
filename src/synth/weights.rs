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
//!   to 1 and which only the weights named there read or write) is driven to VALUE (default
//!   1.1·10⁵) in layer L, in two steps of about (VALUE − 1)/2 ≤ 6·10⁴, so that no single op's
//!   output leaves fp16's range: layer L's attention writes the first step (a constant carried
//!   by one coordinate of its MLA latent), its dense MLP or shared expert the second (one
//!   neuron). The stream passes fp16's 65504 only after layer L and stays below 65504 ×
//!   `routed_scaling_factor`: vLLM's fp16 guard (every sublayer computed at true scale, only the
//!   residual stream held divided by 2.5) fits, while an unguarded fp16 stream overflows after
//!   layer L's FFN. The RMSNorms that read the stream after a step scale the other channels up
//!   by the same factor, so in f32 the model predicts as before. (Real LLMs have such "massive
//!   activations"; this one is made on purpose.)
//!
//! Every row has its own random stream (`SplitMix::for_row`) keyed by the weight's canonical
//! (Hugging Face, stacked-expert) name, so the GGUF and HF forms of one seed hold the same values
//! and rows can be made in any order.

use std::ops::Range;

use crate::model::names::{LayerWeight, LayerWeight::*, WeightId};
use crate::model::Glm5Config;

use crate::rng::SplitMix;

/// Gain of the projections that write into the residual stream.
const OUTPUT_GAIN: f32 = 0.3;
/// The routed scaling factor the experts' output gain is designed for (GLM-5's).
const GLM5_ROUTED_SCALE: f32 = 2.5;
/// The residual channel the fp16-overflow knob drives.
const MASSIVE_CHANNEL: usize = 0;
/// Its value in every embedding row, so a layer can amplify it.
const MASSIVE_BASE: f32 = 1.0;
/// Gate and up weight of the amplifying neuron on that channel.
const MASSIVE_GAIN: f32 = 4.0;
/// The coordinate of layer L's kv latent that carries the massive channel into attention.
const LATENT_CARRIER: usize = 0;
/// How far the carrier outweighs the latent's other coordinates before `kv_a_layernorm` (which
/// then holds it at 1 to 1/(2·256²) whatever the token, and scales the others back up by 256).
const LATENT_DOMINANCE: f32 = 256.0;
/// The attention step is a multiple of this: then it is exact in bf16 and f16, and so is the
/// step divided by 2.5 (a multiple of 512), so vLLM's guarded stream and an unguarded one hold
/// the same value after layer L's attention (see [`Massive::attention_step`]).
const ATTENTION_STEP_QUANTUM: f32 = 1280.0;

/// Drive the residual stream past the fp16 range at layer `layer`.
///
/// Channel 0 goes from 1 to `value` in two steps of about (`value` − 1)/2, each within fp16's
/// range, so that no op's output leaves it:
/// * attention: `kv_a_proj` writes `256·√R·x̂₀` (x̂₀ ≈ 1: `input_layernorm` of the base channel)
///   to latent coordinate 0, which then dominates the latent's RMS, so `kv_a_layernorm` makes it
///   1 for every token (its other weights are 256 times larger to keep the rest of the latent's
///   scale). `kv_b_proj` copies it, alone, into head 0's first value dimension; softmax weights
///   sum to 1, so that head's first context dimension is 1 whatever the attention pattern, and
///   `o_proj` writes [`attention_step`](Massive::attention_step) from it to channel 0. Every
///   other row of these weights ignores the carrier.
/// * FFN: one neuron of the dense MLP or shared expert (gate and up read the channel, down
///   writes [`ffn_step`](Massive::ffn_step) to it).
///
/// Each step sits alone in its row (one nonzero weight), so quantization keeps it to a few
/// parts in 10⁴.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Massive {
    pub layer: u64,
    /// Target value of the massive channel after `layer` (default 1.1·10⁵).
    pub value: f32,
}

impl Massive {
    pub const DEFAULT_VALUE: f32 = 1.1e5;
    /// The most one op writes onto the channel: below fp16's 65504 with room for rounding.
    pub const MAX_STEP: f32 = 6.0e4;
    /// The largest `value`: two steps of at most [`MAX_STEP`](Self::MAX_STEP) on top of the
    /// base, the attention step rounded to its quantum.
    pub const MAX_VALUE: f32 = 1.18e5;

    /// What layer `layer`'s attention adds to the channel: half the way, rounded to a multiple
    /// of 1280. Exact in f16 and bf16, as is its fifth of two; so where the dequantized `o_proj`
    /// weight is within half an f16 step (16) of it (a single-weight row of Q8_0, Q4_K, Q5_K,
    /// Q4_0 or Q5_0 is; bf16 and f16 hold it exactly), an f16 attention output is exactly this,
    /// and the stream after it is the same value whether it is held divided by 2.5 (vLLM's
    /// guard) or not: the two agree until the FFN step overflows the unguarded one.
    pub fn attention_step(&self) -> f32 {
        let half = (self.value - MASSIVE_BASE) / 2.0;
        (half / ATTENTION_STEP_QUANTUM).round() * ATTENTION_STEP_QUANTUM
    }

    /// What layer `layer`'s FFN adds to the channel: the rest of the way to `value`.
    pub fn ffn_step(&self) -> f32 {
        self.value - MASSIVE_BASE - self.attention_step()
    }

    /// The channel between layer `layer`'s attention and its FFN.
    pub fn after_attention(&self) -> f32 {
        MASSIVE_BASE + self.attention_step()
    }
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
                WeightId::FinalNorm => self.norm_row(&mut rng, row, self.massive.map(|m| m.value)),
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

    /// RMSNorm weights near 1. A residual norm that reads the massive channel at `reads`
    /// undoes the channel's share of the RMS, so the other channels keep their scale (and the
    /// channel itself comes out at about 1).
    fn norm_row(&self, rng: &mut SplitMix, row: &mut [f32], reads: Option<f32>) {
        row.iter_mut().for_each(|x| *x = 1.0 + 0.1 * rng.normal());
        if let Some(v) = reads {
            let rescale = v / (row.len() as f32).sqrt();
            row.iter_mut().for_each(|x| *x *= rescale);
            row[MASSIVE_CHANNEL] = 1.0 / (row.len() as f32).sqrt();
        }
    }

    /// The massive channel's value where residual norm `w` of layer `l` reads the stream, when it
    /// is large enough to be compensated (None: it is the base, or the knob is off).
    fn massive_read(&self, l: u64, w: LayerWeight) -> Option<f32> {
        let m = self.massive?;
        if l >= self.cfg.num_hidden_layers {
            // The MTP layer: hnorm reads the main model's last hidden state; its own norms read
            // its own stream (`eh_proj`'s output), which has no massive channel.
            return (w == NextnHnorm).then_some(m.value);
        }
        match w {
            AttnNorm | FfnNorm if l > m.layer => Some(m.value),
            FfnNorm if l == m.layer => Some(m.after_attention()),
            _ => None,
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
        let massive_layer = self.massive.is_some_and(|m| m.layer == l);
        match w {
            // The norms that read the residual stream.
            AttnNorm | FfnNorm | NextnHnorm => {
                self.norm_row(rng, row, self.massive_read(l, w));
                if massive_layer && w == AttnNorm {
                    // The latent carrier reads the base channel through it.
                    row[MASSIVE_CHANNEL] = 1.0;
                }
            }
            KvANorm if massive_layer => {
                self.norm_row(rng, row, None);
                row.iter_mut().for_each(|x| *x *= LATENT_DOMINANCE);
                row[LATENT_CARRIER] = 1.0 / (row.len() as f32).sqrt();
            }
            QANorm | KvANorm | IndexerKNorm | NextnEnorm | NextnSharedHeadNorm => {
                self.norm_row(rng, row, None)
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
        let gain = match w {
            AttnOut | Down | SharedDown => OUTPUT_GAIN,
            // The routed sum is scaled by `routed_scaling_factor`: past GLM-5's 2.5 (DeepSeek-V2's
            // 16 on unnormalized weights) the experts write less, so the sublayer keeps its scale.
            ExpertsDown => {
                OUTPUT_GAIN * (GLM5_ROUTED_SCALE / self.cfg.routed_scaling_factor as f32).min(1.0)
            }
            _ => 1.0,
        };
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
        let only = |row: &mut [f32], col: usize, v: f32| {
            row.iter_mut().for_each(|x| *x = 0.0);
            row[col] = v;
        };
        // The attention step: kv latent carrier → head 0's first value dimension → channel 0.
        let v_carrier = self.cfg.qk_nope_head_dim;
        match w {
            KvA if out_index == LATENT_CARRIER as u64 => {
                let rank = self.cfg.kv_lora_rank as f32;
                only(row, MASSIVE_CHANNEL, LATENT_DOMINANCE * rank.sqrt());
            }
            KvB if out_index == v_carrier => only(row, LATENT_CARRIER, 1.0),
            KvB => row[LATENT_CARRIER] = 0.0,
            AttnOut if out_index == MASSIVE_CHANNEL as u64 => only(row, 0, m.attention_step()),
            AttnOut => row[0] = 0.0,
            _ => {}
        }
        // The FFN step: the amplifying neuron (intermediate index 0) of the dense MLP or shared
        // expert.
        let amplifier = if self.cfg.is_moe_layer(l) {
            [SharedGate, SharedUp, SharedDown]
        } else {
            [Gate, Up, Down]
        };
        if (w == amplifier[0] || w == amplifier[1]) && out_index == 0 {
            only(row, MASSIVE_CHANNEL, MASSIVE_GAIN);
        } else if w == amplifier[2] {
            row[0] = 0.0;
            if out_index == MASSIVE_CHANNEL as u64 {
                // silu(g·h)·(u·h) with h ≈ 1: the FFN norm compensates the channel.
                let act = silu(MASSIVE_GAIN) * MASSIVE_GAIN;
                row[0] = m.ffn_step() / act;
            }
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Check that the knob can work on this config: the layer exists and has a dense MLP or a
/// shared expert to hold the amplifying neuron, and the value leaves fp16's range while each of
/// its two steps, and the value divided by `routed_scaling_factor` (vLLM's guard), stay in it.
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
    if cfg.kv_lora_rank == 0 || cfg.v_head_dim == 0 || cfg.num_attention_heads == 0 {
        return Err(format!(
            "fp16-overflow layer {} has no attention value path to carry the channel",
            m.layer
        ));
    }
    let guarded = FP16_MAX * cfg.routed_scaling_factor as f32;
    let max = Massive::MAX_VALUE.min(guarded);
    if !(m.value > FP16_MAX && m.value <= max) {
        return Err(format!(
            "fp16-overflow value {} must exceed fp16's {FP16_MAX} and be at most {max} (it is \
             reached in two steps of at most {} each, and vLLM's fp16 guard holds it divided by \
             routed_scaling_factor {})",
            m.value,
            Massive::MAX_STEP,
            cfg.routed_scaling_factor
        ));
    }
    Ok(())
}

/// fp16's largest finite value.
const FP16_MAX: f32 = 65504.0;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Preset;

    #[test]
    fn massive_bounds() {
        let cfg = Preset::Tiny.config();
        let m = |layer, value| Massive { layer, value };
        assert!(check_massive(&cfg, &m(1, Massive::DEFAULT_VALUE)).is_ok());
        assert!(check_massive(&cfg, &m(0, Massive::MAX_VALUE)).is_ok());
        assert!(check_massive(&cfg, &m(1, 65504.0)).is_err());
        assert!(check_massive(&cfg, &m(1, 1.2e5)).is_err());
        assert!(check_massive(&cfg, &m(1, f32::INFINITY)).is_err());
        assert!(check_massive(&cfg, &m(1, f32::NAN)).is_err());
        assert!(check_massive(&cfg, &m(3, Massive::DEFAULT_VALUE)).is_err());
    }

    /// Over every value the check allows, both steps stay below MAX_STEP, they add up to the
    /// value, and the attention step and its fifth of two are exact in f16 (the step in bf16 too).
    #[test]
    fn steps_fit_fp16_and_survive_the_guard() {
        use half::{bf16, f16};
        let mut value = 65505.0f32;
        while value <= Massive::MAX_VALUE {
            let m = Massive { layer: 0, value };
            let (a, f) = (m.attention_step(), m.ffn_step());
            assert!(
                a <= Massive::MAX_STEP && f <= Massive::MAX_STEP,
                "{value}: {a} {f}"
            );
            assert!(a > 4096.0 && f > 0.0, "{value}: {a} {f}");
            assert_eq!(MASSIVE_BASE + a + f, value);
            assert_eq!(f16::from_f32(a).to_f32(), a);
            assert_eq!(bf16::from_f32(a).to_f32(), a);
            assert_eq!(f16::from_f32(a / 2.5).to_f32(), a / 2.5);
            // The base vanishes in the sum, held either way.
            assert_eq!(f16::from_f32(a + MASSIVE_BASE).to_f32(), a);
            value += 37.0;
        }
        let d = Massive {
            layer: 0,
            value: Massive::DEFAULT_VALUE,
        };
        assert_eq!(d.attention_step(), 55040.0);
    }

    /// The two steps sit in isolated rows (one nonzero each), so quantization keeps them, and
    /// every other row of the touched weights ignores the carrier.
    #[test]
    fn the_steps_are_single_weights() {
        let cfg = Preset::Tiny.config();
        let m = Massive {
            layer: 1,
            value: Massive::DEFAULT_VALUE,
        };
        let next: Vec<u32> = (0..cfg.vocab_size as u32).collect();
        let gen = WeightGen::new(&cfg, 5, Some(m), &next);
        let (h, nh) = (cfg.hidden_size, cfg.num_attention_heads);
        let (vd, kvl) = (cfg.v_head_dim, cfg.kv_lora_rank);
        let o = gen.rows(WeightId::Layer(1, AttnOut), &[h, nh * vd], 0..h);
        let row0 = &o[..(nh * vd) as usize];
        assert_eq!(row0[0], m.attention_step());
        assert!(row0[1..].iter().all(|&x| x == 0.0));
        assert!(o.chunks(row0.len()).skip(1).all(|r| r[0] == 0.0));
        let kv_rows = nh * (cfg.qk_nope_head_dim + vd);
        let kv_b = gen.rows(WeightId::Layer(1, KvB), &[kv_rows, kvl], 0..kv_rows);
        let carriers: Vec<usize> = kv_b
            .chunks(kvl as usize)
            .enumerate()
            .filter(|(_, r)| r[LATENT_CARRIER] != 0.0)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(carriers, vec![cfg.qk_nope_head_dim as usize]);
        let down = gen.rows(
            WeightId::Layer(1, SharedDown),
            &[h, cfg.moe_intermediate_size],
            0..1,
        );
        let act = silu(MASSIVE_GAIN) * MASSIVE_GAIN;
        assert!((down[0] * act - m.ffn_step()).abs() < 0.01);
        assert!(down[1..].iter().all(|&x| x == 0.0));
        // Layer 0 (before) leaves the carrier alone.
        let o0 = gen.rows(WeightId::Layer(0, AttnOut), &[h, nh * vd], 0..1);
        assert!(o0.iter().all(|&x| x == 0.0), "row 0 writes channel 0");
    }
}
