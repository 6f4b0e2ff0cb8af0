//! Synthetic GLM-5-architecture models in the real file layouts: llama.cpp's `glm-dsa` GGUF and
//! the Hugging Face checkpoint, any size from CI-tiny to GLM-5's real widths, deterministic from
//! a seed, with weights that make a meaningful reference (see [`weights`]).

pub mod family;
mod fp8;
pub mod mix;
mod plan;
pub mod preset;
pub mod tokenizer;
pub mod weights;
mod write;

use std::path::Path;

use crate::model::config::{Glm5Config, IndexerKind};
use crate::model::schema::ExpertForm;
use crate::weights::gguf::{Value, ValueType};
use crate::weights::safetensors_writer::StoreAs;
use crate::weights::GgmlType;

pub use family::SynthFamily;
pub use mix::{Mix, Override};
pub use plan::Planned;
pub use preset::Preset;
pub use tokenizer::SynthTokenizer;
pub use weights::Massive;
pub use write::Written;

/// HF shards hold at most this many bytes by default.
pub const DEFAULT_SHARD_BYTES: u64 = 2 << 30;

/// Everything that decides a synthetic model's bytes.
#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub cfg: Glm5Config,
    pub seed: u64,
    pub mix: Mix,
    /// `--quant GLOB=TYPE`, first match wins.
    pub overrides: Vec<Override>,
    /// Write valid random blocks instead of quantizing generated weights (disk speed).
    pub fast: bool,
    pub massive: Option<Massive>,
    pub shard_bytes: u64,
}

impl SynthSpec {
    pub fn new(cfg: Glm5Config, seed: u64) -> Self {
        SynthSpec {
            cfg,
            seed,
            mix: Mix::F32,
            overrides: Vec::new(),
            fast: false,
            massive: None,
            shard_bytes: DEFAULT_SHARD_BYTES,
        }
    }

    /// The GGML type a GGUF tensor is stored as: the first matching override, else the mix.
    pub fn storage_type(&self, p: &Planned) -> GgmlType {
        mix::choose_type(self.mix, &self.overrides, &p.name, &p.shape, &self.cfg)
    }

    /// The element type of the HF form: f32 or bf16 (the forms real checkpoints come in).
    pub fn hf_store(&self) -> Result<StoreAs, String> {
        match self.mix {
            Mix::F32 => Ok(StoreAs::F32),
            // FP8's unquantized tensors are BF16, as in GLM-5-FP8.
            Mix::Bf16 | Mix::Fp8 | Mix::Fp8Ue8m0 => Ok(StoreAs::Bf16),
            other => Err(format!("the Hugging Face form is f32 or bf16, not {other}")),
        }
    }

    /// The model's tokenizer (byte-level BPE of the config's vocabulary size).
    pub fn tokenizer(&self) -> Result<SynthTokenizer, String> {
        SynthTokenizer::new(self.cfg.vocab_size as usize)
    }

    /// The token each token is followed by in the built-in pattern: its first successor in the
    /// tokenizer's corpus (so "The capital of France is" continues " Paris", and greedy
    /// generation repeats the corpus' first sentence); tokens the corpus never continues go to
    /// the next id.
    pub fn next_token(&self) -> Vec<u32> {
        let v = self.cfg.vocab_size as u32;
        let mut next: Vec<Option<u32>> = vec![None; v as usize];
        for pair in self
            .tokenizer()
            .map(|t| t.corpus_ids())
            .unwrap_or_default()
            .windows(2)
        {
            next[pair[0] as usize].get_or_insert(pair[1]);
        }
        (0..v)
            .map(|t| next[t as usize].unwrap_or((t + 1) % v))
            .collect()
    }

    pub fn weight_gen(&self) -> weights::WeightGen {
        weights::WeightGen::new(&self.cfg, self.seed, self.massive, &self.next_token())
    }

    /// `tokenizer.json` and `tokenizer_config.json` into `dir`, and the special ids into `config`.
    fn tokenizer_hf_files(
        &self,
        dir: &Path,
        config: &mut serde_json::Value,
    ) -> std::io::Result<()> {
        let tok = self.tokenizer().map_err(std::io::Error::other)?;
        std::fs::write(dir.join("tokenizer.json"), tok.tokenizer_json())?;
        std::fs::write(
            dir.join("tokenizer_config.json"),
            tok.tokenizer_config_json(),
        )?;
        config["bos_token_id"] = tok.bos_id().into();
        config["eos_token_id"] = tok.eos_id().into();
        config["pad_token_id"] = tok.eos_id().into();
        Ok(())
    }

    /// Write the GGUF form.
    pub fn write_gguf(&self, path: &Path) -> std::io::Result<Written> {
        write::write_gguf(self, path)
    }

    /// Write the Hugging Face form (a folder).
    pub fn write_hf(&self, dir: &Path, experts: ExpertForm) -> std::io::Result<Written> {
        write::write_hf(self, dir, experts)
    }
}

/// The `ARCH.*` metadata llama.cpp's converter writes for the model (`glm-dsa` for GLM-5,
/// `deepseek2` for the other members): the q LoRA rank only where there is one, the indexer
/// keys only with DSA, the YaRN keys only with YaRN.
pub fn gguf_metadata(spec: &SynthSpec, tokenizer: &SynthTokenizer) -> Vec<(String, Value)> {
    let cfg = &spec.cfg;
    let arch = cfg.member.gguf_arch();
    let u = |v: u64| Value::U32(v as u32);
    let f = |v: f64| Value::F32(v as f32);
    let mut md = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.into()),
        ),
        (
            "general.name".to_string(),
            Value::String(format!(
                "glmcheck synthetic {} (seed {})",
                cfg.member.name(),
                spec.seed
            )),
        ),
        ("general.quantization_version".to_string(), u(2)),
        (
            "general.file_type".to_string(),
            u(spec.mix.file_type() as u64),
        ),
    ];
    let mut fields = vec![
        (
            "block_count",
            u(cfg.num_hidden_layers + cfg.num_nextn_predict_layers),
        ),
        ("context_length", u(cfg.max_position_embeddings)),
        ("embedding_length", u(cfg.hidden_size)),
        ("feed_forward_length", u(cfg.intermediate_size)),
        ("attention.head_count", u(cfg.num_attention_heads)),
        ("attention.head_count_kv", u(1)),
        (
            "attention.key_length",
            u(cfg.kv_lora_rank + cfg.qk_rope_head_dim),
        ),
        ("attention.value_length", u(cfg.kv_lora_rank)),
        ("attention.key_length_mla", u(cfg.qk_head_dim())),
        ("attention.value_length_mla", u(cfg.v_head_dim)),
        ("attention.kv_lora_rank", u(cfg.kv_lora_rank)),
        ("attention.layer_norm_rms_epsilon", f(cfg.rms_norm_eps)),
        ("rope.dimension_count", u(cfg.qk_rope_head_dim)),
        ("rope.freq_base", f(cfg.rope_theta)),
        ("leading_dense_block_count", u(cfg.first_k_dense_replace)),
        ("expert_count", u(cfg.n_routed_experts)),
        ("expert_used_count", u(cfg.num_experts_per_tok)),
        ("expert_shared_count", u(cfg.n_shared_experts)),
        ("expert_feed_forward_length", u(cfg.moe_intermediate_size)),
        ("expert_weights_scale", f(cfg.routed_scaling_factor)),
        ("expert_weights_norm", Value::Bool(cfg.norm_topk_prob)),
        (
            "expert_gating_func",
            u(if cfg.scoring_func == "softmax" { 1 } else { 2 }),
        ),
        ("expert_group_count", u(cfg.n_group)),
        ("expert_group_used_count", u(cfg.topk_group)),
        ("nextn_predict_layers", u(cfg.num_nextn_predict_layers)),
        ("vocab_size", u(cfg.vocab_size)),
    ];
    if cfg.has_q_lora() {
        fields.push(("attention.q_lora_rank", u(cfg.q_lora_rank)));
    }
    if cfg.has_dsa() {
        fields.extend([
            ("attention.indexer.head_count", u(cfg.index_n_heads)),
            ("attention.indexer.key_length", u(cfg.index_head_dim)),
            ("attention.indexer.top_k", u(cfg.index_topk)),
        ]);
    }
    if let Some(y) = &cfg.yarn {
        fields.extend([
            ("rope.scaling.type", Value::String("yarn".into())),
            ("rope.scaling.factor", f(y.factor)),
            (
                "rope.scaling.original_context_length",
                u(y.original_max_position_embeddings),
            ),
            (
                "rope.scaling.yarn_log_multiplier",
                f(0.1 * y.mscale_all_dim.unwrap_or(0.0)),
            ),
        ]);
    }
    md.extend(fields.into_iter().map(|(k, v)| (format!("{arch}.{k}"), v)));
    // llama.cpp reads a file of a 1M context without the key as GLM-5.2's pattern.
    if cfg.indexer_types.contains(&IndexerKind::Shared) || cfg.max_position_embeddings >= 1 << 20 {
        let types = cfg
            .indexer_types
            .iter()
            .map(|k| Value::Bool(*k == IndexerKind::Full))
            .collect();
        md.push((
            format!("{arch}.attention.indexer.types"),
            Value::Array(ValueType::Bool, types),
        ));
    }
    md.extend(tokenizer.gguf_metadata());
    md
}
