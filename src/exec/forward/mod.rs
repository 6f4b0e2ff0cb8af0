//! The GLM-5 forward over all prompt positions at once, on any [`Backend`], recording every
//! docs/design.md §4 stage.
//!
//! It follows transformers' `GlmMoeDsaForCausalLM`: RMSNorms in f32 (`q_a`/`kv_a` norms with eps
//! 1e-6 by default, as transformers builds them), MLA with interleaved (or NeoX) RoPE on the
//! trailing rope dims, the DSA indexer (LayerNorm'd key, ReLU scores weighted per head, causal
//! top-k; shared layers reuse the previous selection), sigmoid routing with the correction bias
//! used for the choice only, group limits, normalisation and the routed scaling factor, a shared
//! expert, dense MLP layers, the final norm and an untied `lm_head`. Only the experts the tokens
//! choose are read. Layer weights are dequantized when the layer runs and dropped after it.

use std::sync::Arc;

use anyhow::{bail, Result};
use rayon::prelude::*;

mod moe;

pub(crate) use moe::route;
pub mod recorder;
mod residual_scale;
pub mod timed;

use crate::exec::attention::{attention, Chosen, KvCache, LayerCache, Step};
use crate::exec::backend::Backend;
use crate::exec::mat::Mat;
use crate::exec::ops::argmax;
use crate::exec::ops::ties::TieBreaks;
use crate::exec::real::Real;
use crate::exec::source::lazy_weight::LazyWeight;
use crate::exec::source::sharder::Sharder;
use crate::exec::source::WeightSource;
use crate::model::names::{LayerWeight, LayerWeight::*, WeightId};
use crate::model::stage::{Place, Stage as StageName};
use crate::trace::writer::{OwnedStage, Stage, StageLater};
use recorder::{record_mat, shared, Discard, Recorder, StageKey};
use residual_scale::ResidualScale;

/// The eps transformers gives `q_a_layernorm` and `kv_a_layernorm` (they are built without one;
/// vLLM and llama.cpp use `rms_norm_eps` instead).
pub const HF_LATENT_NORM_EPS: f64 = 1e-6;

/// Settings where implementations differ.
#[derive(Clone, Copy, Debug)]
pub struct ForwardOptions<'a> {
    /// Eps of the q_a/kv_a RMSNorms (transformers: 1e-6; vLLM, llama.cpp: `rms_norm_eps`).
    pub latent_norm_eps: f64,
    /// Tensor-parallel ranks (vLLM's split, simulated on the CPU; see [`crate::exec::tp`]).
    pub tp: usize,
    /// Expert parallelism: routed experts whole on the rank that owns them instead of split
    /// along their intermediate dimension.
    pub ep: bool,
    /// Near ties at top-k boundaries resolved as the reference did (see [`TieBreaks`]).
    pub ties: Option<&'a TieBreaks>,
}

impl Default for ForwardOptions<'_> {
    fn default() -> Self {
        ForwardOptions {
            latent_norm_eps: HF_LATENT_NORM_EPS,
            tp: 1,
            ep: false,
            ties: None,
        }
    }
}

/// What runs a forward: the weights (with any planted fault), the backend, the options.
pub struct Runner<'a, B> {
    pub src: &'a WeightSource,
    pub be: &'a B,
    pub opts: ForwardOptions<'a>,
}

impl<B> Clone for Runner<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Runner<'_, B> {}

/// A forward split between two runners at a block: the embedding is block 0, layer `l` block
/// `l + 1`, the final norm and lm_head block `L + 1`. Blocks below `switch` run on `below`, the
/// rest on `above` — so that a candidate which shows only its logits can be bisected by layer,
/// the reference computing what comes before the layer under test.
pub struct Hybrid<'a, B> {
    pub below: Runner<'a, B>,
    pub above: Runner<'a, B>,
    pub switch: usize,
}

impl<'a, B> Hybrid<'a, B> {
    /// Every block on `r`.
    pub fn single(r: Runner<'a, B>) -> Self {
        Hybrid {
            below: r,
            above: r,
            switch: 0,
        }
    }

    fn at(&self, block: usize) -> Runner<'a, B> {
        if block < self.switch {
            self.below
        } else {
            self.above
        }
    }
}

/// Run `tokens` through the model at the positions after those in `cache` (all of them for a
/// prompt, one at a time when generating); returns their logits `[T, V]`.
pub fn forward<B: Backend>(
    run: &Hybrid<'_, B>,
    tokens: &[u32],
    cache: &mut KvCache<B::E>,
    rec: &mut dyn Recorder,
) -> Result<Mat<B::E>> {
    let Runner { src, be, opts } = run.at(0);
    let cfg = &src.cfg;
    let (t, h) = (tokens.len(), cfg.hidden_size as usize);
    let vocab = cfg.vocab_size;
    let mut rows = Vec::with_capacity(t * h);
    for &tok in tokens {
        if u64::from(tok) >= vocab {
            bail!("token id {tok} is outside the vocabulary of {vocab}");
        }
        rows.extend(
            src.matrix_rows(WeightId::Embed, u64::from(tok)..u64::from(tok) + 1)?
                .into_data(),
        );
    }
    let mut x = be.placed(Mat::new(t, h, be.hold_values(rows)))?;
    let shape = [t as u64, h as u64];
    rec.record_owned(StageKey::new("embed", &shape, "t d", None), shared(&x)?)?;
    record_embed_parts(tokens, &x, vocab, opts.tp, rec)?;
    let mut scale = ResidualScale::of(src, be);
    x = scale.down(be, x)?;
    let start = cache.len();
    let mut prev_topk: Option<Chosen<B::E>> = None;
    for l in 0..cfg.num_hidden_layers {
        let Runner { src, be, opts } = run.at(l as usize + 1);
        x = scale.convert(be, ResidualScale::of(src, be), x)?;
        scale = ResidualScale::of(src, be);
        let layer = Layer {
            src,
            l,
            t,
            start,
            cache: cache.layer(l as usize),
            rec: &mut *rec,
            be,
            opts,
            scale,
        };
        let began = std::time::Instant::now();
        let (out, selection) = layer.run(&x, prev_topk.take())?;
        rec.layer_seconds(&Place::Layer(l).to_string(), began.elapsed().as_secs_f64());
        x = out;
        prev_topk = selection;
    }
    let Runner { src, be, opts } = run.at(cfg.num_hidden_layers as usize + 1);
    let norm = be.rms_norm(
        &x,
        &src.vector_in(be, WeightId::FinalNorm)?,
        cfg.rms_norm_eps,
    )?;
    let shape = [t as u64, h as u64];
    record_mat(rec, StageKey::new("final_norm", &shape, "t d", None), &norm)?;
    let logits = lm_head(src, &norm, be, opts.tp)?;
    let shape = [t as u64, logits.cols as u64];
    rec.record_owned(
        StageKey::new("logits", &shape, "t v(tp)", None),
        shared(&logits)?,
    )?;
    if opts.tp > 1 {
        // Vocab-parallel lm_head: each rank its slice of the vocabulary, gathered.
        let share = logits.cols / opts.tp;
        for r in 0..opts.tp {
            let part = logits.columns(r * share, share);
            let shape = [t as u64, share as u64];
            let key = StageKey::new("logits", &shape, "t v(tp)", Some(r as u32));
            rec.record_owned(key, shared(&part)?)?;
        }
    }
    Ok(logits)
}

/// Vocab-parallel embedding at TP: each rank looks up the tokens of its vocabulary slice (zeros
/// for the others) and an all-reduce sums them; recorded per rank as partial sums.
fn record_embed_parts<E: Real>(
    tokens: &[u32],
    x: &Mat<E>,
    vocab: u64,
    tp: usize,
    rec: &mut dyn Recorder,
) -> Result<()> {
    if tp < 2 {
        return Ok(());
    }
    let share = vocab / tp as u64;
    for r in 0..tp as u64 {
        let mut part = Mat::zeros(x.rows, x.cols);
        for (i, &tok) in tokens.iter().enumerate() {
            if u64::from(tok) / share == r {
                part.row_mut(i).copy_from_slice(x.row(i));
            }
        }
        let shape = [x.rows as u64, x.cols as u64];
        let key = StageKey::new("embed", &shape, "t d partial(tp)", Some(r as u32));
        rec.record_owned(key, shared(&part)?)?;
    }
    Ok(())
}

/// Greedy generation: the prompt through `rec`, then `n` tokens, each the argmax of the last
/// logits, fed one at a time through the KV cache. Returns the prompt's logits and the tokens.
pub fn generate<B: Backend>(
    run: &Hybrid<'_, B>,
    prompt: &[u32],
    n: usize,
    rec: &mut dyn Recorder,
) -> Result<(Mat<B::E>, Vec<u32>)> {
    let mut cache = KvCache::default();
    let logits = forward(run, prompt, &mut cache, rec)?;
    let mut out = Vec::with_capacity(n);
    let mut last = logits.row(logits.rows - 1).to_vec();
    for _ in 0..n {
        let Some(next) = argmax(&last) else {
            bail!("the model has an empty vocabulary");
        };
        let next = next as u32;
        out.push(next);
        last = forward(run, &[next], &mut cache, &mut Discard)?.into_data();
    }
    Ok((logits, out))
}

/// Vocabulary rows of `lm_head` dequantized at a time: its f32 form (3.8 GB for GLM-5) is never
/// held whole.
const LM_HEAD_ROWS: u64 = 8192;

/// `norm · lm_headᵀ`, in slices of the vocabulary; GGUFs without `output.weight` tie it to the
/// embedding, as llama.cpp does. Vocab-parallel over `tp` ranks as vLLM runs it: each rank its
/// share of the vocabulary on its device (ranks in processes of their own each compute the
/// whole, so that no collective is added).
fn lm_head<B: Backend>(
    src: &WeightSource,
    norm: &Mat<B::E>,
    be: &B,
    tp: usize,
) -> Result<Mat<B::E>> {
    let id = if src.has(WeightId::LmHead) {
        WeightId::LmHead
    } else {
        WeightId::Embed
    };
    let vocab = src.cfg.vocab_size;
    let ranks = if be.collectives_across_processes() {
        1
    } else {
        tp
    } as u64;
    let share = vocab / ranks;
    let slices = (0..ranks)
        .into_par_iter()
        .map(|r| {
            let be = be.on_rank(r as usize);
            let first = r * share;
            let end = if r + 1 == ranks { vocab } else { first + share };
            (first..end)
                .step_by(LM_HEAD_ROWS as usize)
                .map(|start| {
                    let rows = start..(start + LM_HEAD_ROWS).min(end);
                    Ok((
                        start,
                        be.linear(norm, &*src.matrix_rows_in(&be, id, rows)?)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let parts: Vec<(u64, Mat<B::E>)> = slices.into_iter().flatten().collect();
    let mut logits = Mat::zeros(norm.rows, vocab as usize);
    // Hundreds of MB at GLM-5's vocabulary and 512 tokens: rows on the pool's cores.
    logits
        .data_mut()
        .par_chunks_mut((vocab as usize).max(1))
        .enumerate()
        .for_each(|(r, row)| {
            for (start, part) in &parts {
                let start = *start as usize;
                row[start..start + part.cols].copy_from_slice(part.row(r));
            }
        });
    Ok(logits)
}

/// The shape a `[t, …]` stage's part `m` is recorded in: its rows, its split axis, then
/// `tail`'s dims after the first.
fn part_shape<E>(m: &Mat<E>, tail: &[usize]) -> Vec<usize> {
    let inner: usize = tail.iter().skip(1).product();
    let mut s = vec![m.rows, m.cols / inner.max(1)];
    s.extend(tail.iter().skip(1));
    s
}

/// An output and the DSA choice behind it (for shared layers after it).
type WithChoice<E> = (Mat<E>, Option<Chosen<E>>);

/// One decoder layer's run.
struct Layer<'a, B: Backend> {
    src: &'a WeightSource,
    l: u64,
    t: usize,
    /// Position of the first new token.
    start: usize,
    cache: &'a mut LayerCache<B::E>,
    rec: &'a mut dyn Recorder,
    be: &'a B,
    opts: ForwardOptions<'a>,
    scale: ResidualScale<B::E>,
}

impl<B: Backend> Layer<'_, B> {
    fn rec(&mut self, stage: &str, shape: &[usize], dims: &str, values: Stage<'_>) -> Result<()> {
        self.rec_part(stage, shape, dims, None, values)
    }

    /// Record a whole stage whose values the forward hands over (not copied again).
    fn rec_owned(
        &mut self,
        stage: &str,
        shape: &[usize],
        dims: &str,
        values: OwnedStage,
    ) -> Result<()> {
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let name = StageName::layer_stage(self.l, stage).to_string();
        self.rec
            .record_owned(StageKey::new(&name, &shape, dims, None), values)
    }

    /// Record a whole stage whose values are still on their way ([`Recorder::record_later`]).
    fn rec_later(
        &mut self,
        stage: &str,
        shape: &[usize],
        dims: &str,
        values: StageLater,
    ) -> Result<()> {
        if self.rec.discards() {
            return Ok(());
        }
        let len = shape.iter().product();
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let name = StageName::layer_stage(self.l, stage).to_string();
        self.rec
            .record_later(StageKey::new(&name, &shape, dims, None), len, values)
    }

    /// Record one rank's part (`rank` Some) or the whole stage, copied.
    fn rec_part(
        &mut self,
        stage: &str,
        shape: &[usize],
        dims: &str,
        rank: Option<u32>,
        values: Stage<'_>,
    ) -> Result<()> {
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let name = StageName::layer_stage(self.l, stage).to_string();
        self.rec
            .record(StageKey::new(&name, &shape, dims, rank), values)
    }

    /// Record a stage the forward holds as a matrix (one rank's part where `rank` is Some),
    /// its values shared with the writer.
    fn rec_mat_part(
        &mut self,
        stage: &str,
        shape: &[usize],
        dims: &str,
        rank: Option<u32>,
        m: &Mat<B::E>,
    ) -> Result<()> {
        let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let name = StageName::layer_stage(self.l, stage).to_string();
        let key = StageKey::new(&name, &shape, dims, rank);
        if self.rec.takes_stats(&name) {
            if let Some(stats) = m.remote_stats()? {
                return self.rec.record_stats(key, m.len(), stats);
            }
        }
        record_mat(self.rec, key, m)
    }

    fn rec_mat(&mut self, stage: &str, shape: &[usize], dims: &str, m: &Mat<B::E>) -> Result<()> {
        self.rec_mat_part(stage, shape, dims, None, m)
    }

    /// Each rank's part of a `[t, …]` stage (the part's trailing dims `tail`, its split axis
    /// first), or the whole when there is one rank.
    fn rec_parts(
        &mut self,
        stage: &str,
        whole: &Mat<B::E>,
        parts: &[Mat<B::E>],
        tail: &[usize],
        dims: &str,
    ) -> Result<()> {
        if parts.len() <= 1 {
            return self.rec_mat(stage, &part_shape(whole, tail), dims, whole);
        }
        for (r, p) in parts.iter().enumerate() {
            self.rec_mat_part(stage, &part_shape(p, tail), dims, Some(r as u32), p)?;
        }
        Ok(())
    }

    fn w(&self, w: LayerWeight) -> WeightId {
        WeightId::Layer(self.l, w)
    }

    fn sharder(&self) -> Sharder {
        Sharder {
            tp: self.opts.tp,
            ep: self.opts.ep,
            fault: self.src.fault(),
        }
    }

    fn matrix(&self, w: LayerWeight) -> Result<std::sync::Arc<B::Weight>> {
        self.src.matrix_in(self.be, self.w(w))
    }

    fn vector(&self, w: LayerWeight) -> Result<Vec<B::E>> {
        self.src.vector_in(self.be, self.w(w))
    }

    /// The layer's output and its DSA selection (for shared layers after it).
    fn run(mut self, x: &Mat<B::E>, prev_topk: Option<Chosen<B::E>>) -> Result<WithChoice<B::E>> {
        let cfg = &self.src.cfg;
        let (t, h) = (self.t, cfg.hidden_size as usize);
        let be = self.be;
        let hn = be.rms_norm(x, &self.vector(AttnNorm)?, cfg.rms_norm_eps)?;
        self.rec_mat("attn_norm", &[t, h], "t d", &hn)?;
        let (attn, selection) = self.attention(&hn, prev_topk)?;
        let x = be.add(x, &self.scale.down(be, attn)?)?;
        self.rec_mat("attn_resid", &[t, h], "t d", &self.scale.up(&x))?;
        let fin = be.rms_norm(&x, &self.vector(FfnNorm)?, cfg.rms_norm_eps)?;
        self.rec_mat("ffn_norm", &[t, h], "t d", &fin)?;
        let began = std::time::Instant::now();
        let ffn = if cfg.is_moe_layer(self.l) {
            self.moe(&fin)?
        } else {
            self.mlp(&fin, Gate, Up, Down)?
        };
        let ffn_seconds = began.elapsed().as_secs_f64();
        let ffn_label = StageName::layer_stage(self.l, "ffn").to_string();
        self.rec.layer_seconds(&ffn_label, ffn_seconds);
        self.rec_mat("ffn.out", &[t, h], "t d", &ffn)?;
        let out = be.add(&x, &self.scale.down(be, ffn)?)?;
        self.rec_mat("out", &[t, h], "t d", &self.scale.up(&out))?;
        Ok((out, selection))
    }

    fn mlp(
        &self,
        x: &Mat<B::E>,
        gate: LayerWeight,
        up: LayerWeight,
        down: LayerWeight,
    ) -> Result<Mat<B::E>> {
        Ok(self.mlp_parts(x, gate, up, down)?.0)
    }

    /// An MLP's output and, per tensor-parallel rank, its partial output (gate/up
    /// ColumnParallel, down RowParallel; no parts at TP 1).
    fn mlp_parts(
        &self,
        x: &Mat<B::E>,
        gate: LayerWeight,
        up: LayerWeight,
        down: LayerWeight,
    ) -> Result<crate::exec::tp::WithParts<B::E>> {
        let be = self.be;
        if self.opts.tp > 1 {
            let w = |role| LazyWeight::layer(self.src, self.l, role);
            let weights = [&w(gate), &w(up), &w(down)];
            let parts = crate::exec::tp::mlp_partials(be, x, weights, self.sharder())?;
            return Ok((be.all_reduce(&parts)?, parts));
        }
        if be.fuses_mlp() {
            // A GPU keeps the intermediates (a dense layer's are twice the hidden width) on
            // its device instead of fetching and resending them.
            let [g, u, d] = [gate, up, down].map(|role| self.matrix(role));
            return Ok((be.mlp(x, &*g?, &*u?, &*d?)?, Vec::new()));
        }
        let g = be.linear(x, &*self.matrix(gate)?)?;
        let u = be.linear(x, &*self.matrix(up)?)?;
        let h = be.silu_mul(&g, &u)?;
        Ok((be.linear(&h, &*self.matrix(down)?)?, Vec::new()))
    }

    /// Attention over the cache, recording its stages.
    fn attention(
        &mut self,
        hn: &Mat<B::E>,
        prev: Option<Chosen<B::E>>,
    ) -> Result<WithChoice<B::E>> {
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
            be: self.be,
            latent_norm_eps: self.opts.latent_norm_eps,
            sharder: self.sharder(),
            ties: self.opts.ties,
        };
        let a = attention(step, hn, self.cache, prev)?;
        if let Some((q_a, q_a_norm)) = &a.q_a {
            self.rec_mat("attn.q_a", &[t, q_a.cols], "t d", q_a)?;
            self.rec_mat("attn.q_a_norm", &[t, q_a_norm.cols], "t d", q_a_norm)?;
        }
        let q_tail = [nh, nope + rope_d];
        self.rec_parts("attn.q", &a.q, &a.parts.q, &q_tail, "t h(tp) d")?;
        self.rec_mat("attn.kv_a", &[t, a.kv_a.cols], "t d", &a.kv_a)?;
        self.rec_mat(
            "attn.kv_a_norm",
            &[t, a.kv_a_norm.cols],
            "t d",
            &a.kv_a_norm,
        )?;
        let kv_tail = [nh, nope + vd];
        self.rec_parts("attn.kv", &a.kv, &a.parts.kv, &kv_tail, "t h(tp) d")?;
        self.rec_parts("attn.q_rope", &a.q_rope, &[], &[nh, rope_d], "t h(tp) d")?;
        self.rec_mat("attn.k_rope", &[t, rope_d], "t d", &a.k_rope)?;
        match &a.selection {
            None => {}
            Some(Chosen::Known(selection, gap)) => {
                let k = selection.first().map_or(0, Vec::len);
                let flat = OwnedStage::I32(selection.concat());
                self.rec_owned("attn.index_topk", &[t, k], "t k", flat)?;
                if let Some(gap) = gap {
                    self.rec("attn.index_gap", &[t], "t", B::E::stage(gap))?;
                }
            }
            Some(Chosen::Ranking(ranking)) => {
                // Recorded when ranked: the writer waits for it, the forward goes on.
                let (k, ranked) = (ranking.k(), ranking.clone());
                let flat = Box::new(move || Ok(OwnedStage::I32(ranked.get()?.0.concat())));
                self.rec_later("attn.index_topk", &[t, k], "t k", flat)?;
                let ranked = ranking.clone();
                let gap =
                    Box::new(move || Ok(B::E::shared_stage(Arc::new(ranked.get()?.1.clone()))));
                self.rec_later("attn.index_gap", &[t], "t", gap)?;
            }
        }
        self.rec_parts("attn.ctx", &a.ctx, &a.parts.ctx, &[nh, vd], "t h(tp) d")?;
        // After the all-reduce, and at TP each rank's partial sum before it: a missing or
        // doubled all-reduce shows as the one disagreeing with the sum of the others.
        self.rec_mat("attn.out", &[t, a.out.cols], "t d", &a.out)?;
        if !a.parts.out.is_empty() {
            self.rec_parts("attn.out", &a.out, &a.parts.out, &[], "t d partial(tp)")?;
        }
        Ok((a.out, a.selection))
    }
}
