//! The GLM-5 forward over all prompt positions at once, in f32, recording every DESIGN §4 stage.
//!
//! It follows transformers' `GlmMoeDsaForCausalLM`: RMSNorms in f32 (`q_a`/`kv_a` norms with eps
//! 1e-6 by default, as transformers builds them), MLA with interleaved (or NeoX) RoPE on the
//! trailing rope dims, the DSA indexer (LayerNorm'd key, ReLU scores weighted per head, causal
//! top-k; shared layers reuse the previous selection), sigmoid routing with the correction bias
//! used for the choice only, group limits, normalisation and the routed scaling factor, a shared
//! expert, dense MLP layers, the final norm and an untied `lm_head`. Only the experts the tokens
//! choose are read. Layer weights are dequantized when the layer runs and dropped after it.

use anyhow::{bail, Result};

use super::attention::{attention, KvCache, Step, NO_BOUNDARY};
use super::backend::{Cpu, Precision};
use super::mat::Mat;
use super::ops::{sigmoid, softmax, topk};
use super::source::WeightSource;
use crate::model::names::{LayerWeight, LayerWeight::*, WeightId};
use crate::trace::writer::Stage;

/// The eps transformers gives `q_a_layernorm` and `kv_a_layernorm` (they are built without one;
/// vLLM and llama.cpp use `rms_norm_eps` instead).
pub const HF_LATENT_NORM_EPS: f64 = 1e-6;

/// Receives each stage as it is computed: name, row-major shape, dims spec, values.
pub trait Recorder {
    fn record(&mut self, name: &str, shape: &[u64], dims: &str, values: Stage<'_>) -> Result<()>;
}

/// Records nothing: generation steps after the traced prompt.
pub struct Discard;

impl Recorder for Discard {
    fn record(&mut self, _: &str, _: &[u64], _: &str, _: Stage<'_>) -> Result<()> {
        Ok(())
    }
}

/// Settings where implementations differ.
#[derive(Clone, Copy, Debug)]
pub struct ForwardOptions {
    /// Eps of the q_a/kv_a RMSNorms (transformers: 1e-6; vLLM, llama.cpp: `rms_norm_eps`).
    pub latent_norm_eps: f64,
    /// f32, or bf16/f16 emulation (see [`super::backend`]).
    pub precision: Precision,
}

impl ForwardOptions {
    fn backend(&self) -> Cpu {
        Cpu {
            precision: self.precision,
        }
    }
}

impl Default for ForwardOptions {
    fn default() -> Self {
        ForwardOptions {
            latent_norm_eps: HF_LATENT_NORM_EPS,
            precision: Precision::F32,
        }
    }
}

fn f32s(m: &Mat) -> Stage<'_> {
    Stage::F32(&m.data)
}

/// Run `tokens` through the model at the positions after those in `cache` (all of them for a
/// prompt, one at a time when generating); returns their logits `[T, V]`.
pub fn forward(
    src: &WeightSource,
    tokens: &[u32],
    cache: &mut KvCache,
    opts: ForwardOptions,
    rec: &mut dyn Recorder,
) -> Result<Mat> {
    let cfg = &src.cfg;
    if cfg.yarn.is_some() {
        bail!("YaRN rope scaling is not supported by the reference executor yet");
    }
    let (t, h) = (tokens.len(), cfg.hidden_size as usize);
    let vocab = cfg.vocab_size;
    let mut rows = Vec::with_capacity(t * h);
    for &tok in tokens {
        if u64::from(tok) >= vocab {
            bail!("token id {tok} is outside the vocabulary of {vocab}");
        }
        rows.extend(
            src.matrix_rows(WeightId::Embed, u64::from(tok)..u64::from(tok) + 1)?
                .data,
        );
    }
    let be = opts.backend();
    be.round(&mut rows);
    let mut x = Mat::new(t, h, rows);
    rec.record("embed", &[t as u64, h as u64], "t d", f32s(&x))?;
    let start = cache.len();
    let mut prev_topk: Option<Vec<Vec<i32>>> = None;
    for l in 0..cfg.num_hidden_layers {
        let layer = Layer {
            src,
            l,
            t,
            start,
            cache: cache.layer(l as usize),
            rec: &mut *rec,
            opts,
        };
        let (out, selection) = layer.run(&x, prev_topk.take())?;
        x = out;
        prev_topk = Some(selection);
    }
    let norm = be.rms_norm(&x, &src.vector(WeightId::FinalNorm)?, cfg.rms_norm_eps);
    rec.record("final_norm", &[t as u64, h as u64], "t d", f32s(&norm))?;
    let logits = lm_head(src, &norm, be)?;
    rec.record(
        "logits",
        &[t as u64, logits.cols as u64],
        "t v(tp)",
        f32s(&logits),
    )?;
    Ok(logits)
}

/// Greedy generation: the prompt through `rec`, then `n` tokens, each the argmax of the last
/// logits, fed one at a time through the KV cache. Returns the prompt's logits and the tokens.
pub fn generate(
    src: &WeightSource,
    prompt: &[u32],
    n: usize,
    opts: ForwardOptions,
    rec: &mut dyn Recorder,
) -> Result<(Mat, Vec<u32>)> {
    let mut cache = KvCache::default();
    let logits = forward(src, prompt, &mut cache, opts, rec)?;
    let mut out = Vec::with_capacity(n);
    let mut last = logits.row(logits.rows - 1).to_vec();
    for _ in 0..n {
        let next = topk(&last, 1)[0] as u32;
        out.push(next);
        last = forward(src, &[next], &mut cache, opts, &mut Discard)?.data;
    }
    Ok((logits, out))
}

/// Vocabulary rows of `lm_head` dequantized at a time: its f32 form (3.8 GB for GLM-5) is never
/// held whole.
const LM_HEAD_ROWS: u64 = 8192;

/// `norm · lm_headᵀ`, in slices of the vocabulary; GGUFs without `output.weight` tie it to the
/// embedding, as llama.cpp does.
fn lm_head(src: &WeightSource, norm: &Mat, be: Cpu) -> Result<Mat> {
    let id = if src.has(WeightId::LmHead) {
        WeightId::LmHead
    } else {
        WeightId::Embed
    };
    let vocab = src.cfg.vocab_size;
    let mut logits = Mat::new(
        norm.rows,
        vocab as usize,
        vec![0.0; norm.rows * vocab as usize],
    );
    for start in (0..vocab).step_by(LM_HEAD_ROWS as usize) {
        let end = (start + LM_HEAD_ROWS).min(vocab);
        let part = be.linear(norm, &src.matrix_rows(id, start..end)?)?;
        for r in 0..norm.rows {
            logits.row_mut(r)[start as usize..end as usize].copy_from_slice(part.row(r));
        }
    }
    Ok(logits)
}

/// One decoder layer's run.
struct Layer<'a> {
    src: &'a WeightSource,
    l: u64,
    t: usize,
    /// Position of the first new token.
    start: usize,
    cache: &'a mut super::attention::LayerCache,
    rec: &'a mut dyn Recorder,
    opts: ForwardOptions,
}

impl Layer<'_> {
    fn rec(&mut self, stage: &str, shape: &[usize], dims: &str, values: Stage<'_>) -> Result<()> {
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        self.rec
            .record(&format!("L{}.{stage}", self.l), &shape, dims, values)
    }

    fn w(&self, w: LayerWeight) -> WeightId {
        WeightId::Layer(self.l, w)
    }

    /// The layer's output and its DSA selection (for shared layers after it).
    fn run(mut self, x: &Mat, prev_topk: Option<Vec<Vec<i32>>>) -> Result<(Mat, Vec<Vec<i32>>)> {
        let cfg = &self.src.cfg;
        let (t, h) = (self.t, cfg.hidden_size as usize);
        let be = self.opts.backend();
        let hn = be.rms_norm(x, &self.src.vector(self.w(AttnNorm))?, cfg.rms_norm_eps);
        self.rec("attn_norm", &[t, h], "t d", f32s(&hn))?;
        let (attn, selection) = self.attention(&hn, prev_topk)?;
        let x = be.add(x, &attn);
        self.rec("attn_resid", &[t, h], "t d", f32s(&x))?;
        let fin = be.rms_norm(&x, &self.src.vector(self.w(FfnNorm))?, cfg.rms_norm_eps);
        self.rec("ffn_norm", &[t, h], "t d", f32s(&fin))?;
        let ffn = if cfg.is_moe_layer(self.l) {
            self.moe(&fin)?
        } else {
            self.mlp(&fin, Gate, Up, Down)?
        };
        self.rec("ffn.out", &[t, h], "t d", f32s(&ffn))?;
        let out = be.add(&x, &ffn);
        self.rec("out", &[t, h], "t d", f32s(&out))?;
        Ok((out, selection))
    }

    fn mlp(&self, x: &Mat, gate: LayerWeight, up: LayerWeight, down: LayerWeight) -> Result<Mat> {
        let be = self.opts.backend();
        let g = be.linear(x, &self.src.matrix(self.w(gate))?)?;
        let u = be.linear(x, &self.src.matrix(self.w(up))?)?;
        be.linear(&be.silu_mul(&g, &u), &self.src.matrix(self.w(down))?)
    }

    /// Attention over the cache, recording its stages.
    fn attention(&mut self, hn: &Mat, prev: Option<Vec<Vec<i32>>>) -> Result<(Mat, Vec<Vec<i32>>)> {
        let cfg = &self.src.cfg;
        let t = self.t;
        let (nh, nope, rope_d, vd) = (
            cfg.num_attention_heads as usize,
            cfg.qk_nope_head_dim as usize,
            cfg.qk_rope_head_dim as usize,
            cfg.v_head_dim as usize,
        );
        let step = Step {
            src: self.src,
            l: self.l,
            start: self.start,
            be: self.opts.backend(),
            latent_norm_eps: self.opts.latent_norm_eps,
        };
        let a = attention(step, hn, self.cache, prev)?;
        self.rec("attn.q_a", &[t, a.q_a.cols], "t d", f32s(&a.q_a))?;
        self.rec(
            "attn.q_a_norm",
            &[t, a.q_a_norm.cols],
            "t d",
            f32s(&a.q_a_norm),
        )?;
        self.rec("attn.q", &[t, nh, nope + rope_d], "t h(tp) d", f32s(&a.q))?;
        self.rec("attn.kv_a", &[t, a.kv_a.cols], "t d", f32s(&a.kv_a))?;
        self.rec(
            "attn.kv_a_norm",
            &[t, a.kv_a_norm.cols],
            "t d",
            f32s(&a.kv_a_norm),
        )?;
        self.rec("attn.kv", &[t, nh, nope + vd], "t h(tp) d", f32s(&a.kv))?;
        self.rec(
            "attn.q_rope",
            &[t, nh, rope_d],
            "t h(tp) d",
            Stage::F32(&a.q_rope),
        )?;
        self.rec("attn.k_rope", &[t, rope_d], "t d", f32s(&a.k_rope))?;
        let k = a.selection.first().map_or(0, Vec::len);
        let flat: Vec<i32> = a.selection.iter().flatten().copied().collect();
        self.rec("attn.index_topk", &[t, k], "t k", Stage::I32(&flat))?;
        if let Some(gap) = &a.selection_gap {
            self.rec("attn.index_gap", &[t], "t", Stage::F32(gap))?;
        }
        self.rec("attn.ctx", &[t, nh, vd], "t h(tp) d", Stage::F32(&a.ctx))?;
        self.rec("attn.out", &[t, a.out.cols], "t d", f32s(&a.out))?;
        Ok((a.out, a.selection))
    }

    fn moe(&mut self, x: &Mat) -> Result<Mat> {
        let cfg = &self.src.cfg;
        let (t, h) = (self.t, cfg.hidden_size as usize);
        let e = cfg.n_routed_experts as usize;
        let be = self.opts.backend();
        let logits = be.linear_f32(x, &self.src.matrix(self.w(Router))?)?;
        self.rec("moe.router_logits", &[t, e], "t e", f32s(&logits))?;
        let bias = self.src.vector(self.w(RouterBias))?;
        let (mut ids, mut weights, mut gaps) = (
            Vec::with_capacity(t),
            Vec::with_capacity(t),
            Vec::with_capacity(t),
        );
        for s in 0..t {
            let (i, w, gap) = route(cfg, logits.row(s), &bias);
            ids.push(i);
            weights.push(w);
            gaps.push(gap);
        }
        let k = cfg.num_experts_per_tok as usize;
        let flat_ids: Vec<i32> = ids.iter().flatten().map(|&i| i as i32).collect();
        self.rec("moe.topk_ids", &[t, k], "t k", Stage::I32(&flat_ids))?;
        let flat_w: Vec<f32> = weights.iter().flatten().copied().collect();
        self.rec("moe.topk_weights", &[t, k], "t k", Stage::F32(&flat_w))?;
        self.rec("moe.topk_gap", &[t], "t", Stage::F32(&gaps))?;
        let mut routed = Mat::new(t, h, vec![0.0; t * h]);
        let mut used: Vec<usize> = ids.iter().flatten().copied().collect();
        used.sort_unstable();
        used.dedup();
        for expert in used {
            let [gate, up, down] = self.src.expert(self.l, expert as u64)?;
            let rows: Vec<(usize, f32)> = (0..t)
                .filter_map(|s| {
                    ids[s]
                        .iter()
                        .position(|&i| i == expert)
                        .map(|k| (s, weights[s][k]))
                })
                .collect();
            let xs = Mat::new(
                rows.len(),
                h,
                rows.iter().flat_map(|&(s, _)| x.row(s).to_vec()).collect(),
            );
            let y = be.linear(
                &be.silu_mul(&be.linear(&xs, &gate)?, &be.linear(&xs, &up)?),
                &down,
            )?;
            for (r, &(s, w)) in rows.iter().enumerate() {
                routed
                    .row_mut(s)
                    .iter_mut()
                    .zip(y.row(r))
                    .for_each(|(o, v)| *o += w * v);
            }
        }
        be.round(&mut routed.data);
        self.rec("moe.routed", &[t, h], "t d partial(tp)", f32s(&routed))?;
        let shared = if cfg.n_shared_experts > 0 {
            self.mlp(x, SharedGate, SharedUp, SharedDown)?
        } else {
            Mat::new(t, h, vec![0.0; t * h])
        };
        self.rec("moe.shared", &[t, h], "t d partial(tp)", f32s(&shared))?;
        Ok(be.add(&routed, &shared))
    }
}

/// One token's expert choice from its router logits: expert ids, their weights, and the choice
/// score of the k-th expert minus the best unchosen one (how close the choice came to a tie).
fn route(
    cfg: &crate::model::Glm5Config,
    logits: &[f32],
    bias: &[f32],
) -> (Vec<usize>, Vec<f32>, f32) {
    let scores: Vec<f32> = if cfg.scoring_func == "softmax" {
        let mut s = logits.to_vec();
        softmax(&mut s);
        s
    } else {
        logits.iter().map(|&v| sigmoid(v)).collect()
    };
    let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let (groups, per) = (
        cfg.n_group as usize,
        cfg.n_routed_experts as usize / cfg.n_group as usize,
    );
    if groups > 1 {
        // A group's score is the sum of its two best; only the best `topk_group` groups compete.
        let group_score: Vec<f32> = choice
            .chunks(per)
            .map(|g| topk(g, 2).iter().map(|&i| g[i]).sum())
            .collect();
        let keep = topk(&group_score, cfg.topk_group as usize);
        for (g, chunk) in choice.chunks_mut(per).enumerate() {
            if !keep.contains(&g) {
                chunk.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            }
        }
    }
    let k = cfg.num_experts_per_tok as usize;
    let mut ids = topk(&choice, k + 1);
    let gap = match (ids.get(k - 1), ids.get(k)) {
        (Some(&a), Some(&b)) if choice[b].is_finite() => choice[a] - choice[b],
        _ => NO_BOUNDARY,
    };
    ids.truncate(k);
    let mut w: Vec<f32> = ids.iter().map(|&i| scores[i]).collect();
    if cfg.norm_topk_prob {
        let denom = w.iter().sum::<f32>() + 1e-20;
        w.iter_mut().for_each(|v| *v /= denom);
    }
    w.iter_mut()
        .for_each(|v| *v *= cfg.routed_scaling_factor as f32);
    (ids, w, gap)
}
