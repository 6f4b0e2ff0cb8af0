//! The table of settings bisect compares ([`KEYS`]) and what becomes of every other key
//! llama.cpp's loaders of the family (glm-dsa, deepseek2, deepseek32) read ([`OTHER_KEYS`]).

use crate::compare::FaultClass;

/// A setting bisect compares: its GGUF key (without the arch prefix) where llama.cpp has one,
/// the reference config's fields of the same role, the stages (without `L{n}.`) it changes
/// first, any of which may be the first divergence, the class of what it does, and what it
/// does.
pub struct Key {
    pub key: Option<&'static str>,
    pub fields: &'static [&'static str],
    pub stages: &'static [&'static str],
    pub class: FaultClass,
    pub does: &'static str,
}

pub(super) const ROPE: &[&str] = &["attn.q_rope", "attn.k_rope"];

/// Every setting compared with the reference's config (`bisect --list-faults` prints them): the
/// keys of llama.cpp's glm-dsa loader that change numbers without failing the load, and the
/// config fields of the same roles (two, the rotary styles, llama.cpp fixes by architecture).
/// The keys that fix a tensor's shape (widths, counts, ranks) are checked by the loader against
/// the tensors; [`OTHER_KEYS`] says what becomes of every other key read for glm-dsa.
pub const KEYS: [Key; 14] = [
    Key {
        key: Some("rope.scaling.type"),
        fields: &["yarn"],
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does:
            "the scaling (with `rope.scaling.factor` and `rope.scaling.original_context_length`) \
               rescales every rotary position or frequency",
    },
    Key {
        key: Some("rope.scaling.yarn_log_multiplier"),
        fields: &["yarn"],
        stages: &["attn.q_rope", "attn.k_rope", "attn.ctx"],
        class: FaultClass::RopeMismatch,
        does: "0.1·mscale_all_dim (deepseek2, deepseek32; glm-dsa never reads it): absent or 0, \
               llama.cpp scales cos/sin by YaRN's mscale and the softmax by its square, where \
               DeepSeek's YaRN leaves cos/sin unscaled and the softmax × mscale_all_dim's \
               mscale²; deepseek32 takes mscale 1 beside any other mscale_all_dim",
    },
    Key {
        key: Some("rope.freq_base"),
        fields: &["rope_theta"],
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "the rotary frequencies follow the base",
    },
    Key {
        key: Some("attention.layer_norm_rms_epsilon"),
        fields: &["rms_norm_eps"],
        stages: &["attn_norm"],
        class: FaultClass::NormEpsMismatch,
        does: "every RMSNorm divides by sqrt(mean(x²) + eps)",
    },
    Key {
        key: Some("expert_weights_scale"),
        fields: &["routed_scaling_factor"],
        stages: &["moe.topk_weights"],
        class: FaultClass::ScaleMismatch,
        does: "the routing weights are multiplied by it",
    },
    Key {
        key: Some("expert_weights_norm"),
        fields: &["norm_topk_prob"],
        stages: &["moe.topk_weights"],
        class: FaultClass::RouterMismatch,
        does: "it decides whether the chosen experts' weights are divided by their sum",
    },
    Key {
        key: Some("rope.scaling.attn_factor"),
        fields: &["yarn"],
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "it multiplies every rotary embedding's magnitude, and its square the attention's \
               softmax scale",
    },
    Key {
        key: Some("attention.indexer.top_k"),
        fields: &["index_topk"],
        stages: &["attn.index_topk"],
        class: FaultClass::IndexerMismatch,
        does: "the DSA indexer keeps that many key positions for each query",
    },
    Key {
        key: Some("attention.indexer.types"),
        fields: &["indexer_types"],
        stages: &["attn.index_topk"],
        class: FaultClass::IndexerMismatch,
        does: "a layer marked 0 reuses the previous full layer's top-k instead of its own \
               (absent: every layer full below a context_length of 1048576, else GLM-5.2's \
               pattern)",
    },
    Key {
        key: Some("expert_used_count"),
        fields: &["num_experts_per_tok"],
        stages: &["moe.topk_ids"],
        class: FaultClass::RouterMismatch,
        does: "the router chooses that many experts for each token",
    },
    Key {
        key: Some("expert_group_count"),
        fields: &["n_group", "topk_group"],
        stages: &["moe.topk_ids"],
        class: FaultClass::RouterMismatch,
        does: "with more than one group (and `expert_group_used_count` fewer), the router \
               chooses experts only from the best groups",
    },
    Key {
        key: Some("expert_gating_func"),
        fields: &["scoring_func"],
        stages: &["moe.topk_ids", "moe.topk_weights"],
        class: FaultClass::RouterMismatch,
        does: "the router's scores, and so the experts chosen and their weights, come from it",
    },
    Key {
        key: None,
        fields: &["rope_interleave"],
        stages: ROPE,
        class: FaultClass::RopeMismatch,
        does: "MLA's rotary embedding turns adjacent pairs (true) or the two halves (false)",
    },
    Key {
        key: None,
        fields: &["indexer_rope_interleave"],
        stages: &["attn.index_topk"],
        class: FaultClass::IndexerMismatch,
        does: "the indexer's rotary embedding turns adjacent pairs (true) or the two halves \
               (false)",
    },
];

/// The other keys llama.cpp's loaders read for the family (its shared hyperparameters and the
/// glm-dsa, deepseek2 and deepseek32 loaders' own), each with what becomes of it: compared as
/// part of a key of [`KEYS`], checked by the load against the tensors' shapes, without effect
/// on the logits, or read only for another architecture. A test holds this list and [`KEYS`] to
/// llama.cpp's own source.
pub const OTHER_KEYS: [(&str, &str); 45] = [
    ("general.name", "informational"),
    (
        "context_length",
        "no effect on a prompt's logits; it picks the indexer types' default",
    ),
    (
        "embedding_length",
        "shapes every tensor: the load checks it",
    ),
    ("embedding_length_out", "embedding output only"),
    (
        "attention.causal",
        "not compared: false would make attention bidirectional, and no \
      fault class names an attention mask yet",
    ),
    ("pooling_type", "embedding output only"),
    ("classifier.pooling_type", "embedding output only"),
    ("classifier.output_labels", "classifier output only"),
    (
        "block_count",
        "the tensors' names and count: the load checks it",
    ),
    (
        "nextn_predict_layers",
        "the MTP tensors' names: the load checks it",
    ),
    (
        "expert_count",
        "the experts' tensors' shapes: the load checks it",
    ),
    (
        "expert_group_used_count",
        "compared with `expert_group_count`",
    ),
    (
        "feed_forward_length",
        "the dense layers' tensors' shapes: the load checks it",
    ),
    (
        "attention.head_count",
        "the attention tensors' shapes: the load checks it",
    ),
    (
        "attention.head_count_kv",
        "MLA's cache rows: a wrong value fails the first graph",
    ),
    ("rope.scaling.finetuned", "read, never used"),
    (
        "rope.scaling.original_context_length",
        "compared with `rope.scaling.type` under YaRN, \
      without effect otherwise",
    ),
    ("rope.scaling.factor", "compared with `rope.scaling.type`"),
    (
        "rope.scale_linear",
        "compared with `rope.scaling.type` (the factor's older name)",
    ),
    ("rope.scaling.alpha", "read, unused by glm-dsa"),
    (
        "attention.key_length",
        "MLA's cache rows and the rope width's default: the tensors' \
      shapes check it",
    ),
    ("attention.value_length", "unused by MLA"),
    (
        "rope.dimension_count",
        "the rope width: the tensors' shapes check it",
    ),
    (
        "attention.key_length_swa",
        "unused: glm-dsa has no sliding-window layers",
    ),
    (
        "attention.value_length_swa",
        "unused: glm-dsa has no sliding-window layers",
    ),
    (
        "rope.dimension_count_swa",
        "unused: glm-dsa has no sliding-window layers",
    ),
    ("features_length", "read only for WavTokenizer"),
    ("posnet.embedding_length", "read only for WavTokenizer"),
    ("posnet.block_count", "read only for WavTokenizer"),
    ("convnext.embedding_length", "read only for WavTokenizer"),
    ("convnext.block_count", "read only for WavTokenizer"),
    (
        "expert_feed_forward_length",
        "the experts' tensors' shapes: the load checks it",
    ),
    (
        "rope.dimension_sections",
        "unused: glm-dsa's rotary style is fixed",
    ),
    (
        "expert_shared_count",
        "the shared expert's tensors' shapes: the load checks it",
    ),
    (
        "leading_dense_block_count",
        "which layers hold dense or expert tensors: the load checks it",
    ),
    (
        "attention.q_lora_rank",
        "the q latent's tensors' shapes: the load checks it",
    ),
    (
        "attention.kv_lora_rank",
        "the kv latent's tensors' shapes: the load checks it",
    ),
    (
        "attention.key_length_mla",
        "the per-head key width: the tensors' shapes check it",
    ),
    (
        "attention.value_length_mla",
        "the per-head value width: the tensors' shapes check it",
    ),
    (
        "attention.indexer.head_count",
        "the indexer's tensors' shapes: the load checks it",
    ),
    (
        "attention.indexer.key_length",
        "the indexer's tensors' shapes: the load checks it",
    ),
    (
        "vocab_size",
        "deepseek2: with the token list's length, its test for GLM-4.7-Flash's shape where \
         `expert_gating_func` is absent, compared with that key",
    ),
    (
        "tokenizer.ggml.tokens",
        "deepseek2: the vocabulary's size where `vocab_size` is absent (see `vocab_size`)",
    ),
    (
        "attention.temperature_scale",
        "deepseek2: Mistral Large 3's query temperature; no member of the family writes it",
    ),
    (
        "attention.temperature_length",
        "deepseek2: Mistral Large 3's query temperature; no member of the family writes it",
    ),
];
