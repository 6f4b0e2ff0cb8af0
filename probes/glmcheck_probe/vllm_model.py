"""What the vLLM probe knows of vLLM's GLM-5 / DeepSeek-V2 model tree: the module classes by
role, the parameter names and the module classes that own them, and the checks that raise
`UnknownModel` for anything else. Kept apart so that the hooks and the shard manifest read one
list of names, and a renamed vLLM class is fixed in one place.

The tree is recognised by module path and class name only (no vLLM import).
"""

import re
import sys

import torch

# vLLM's classes by role. DeepSeekV2FusedQkvAProjLinear and GateLinear subclass the parallel
# linear classes; DCPGroupColumnParallelLinear is q_b_proj under decode context parallelism.
EMBED = {"VocabParallelEmbedding"}
LM_HEAD = {"ParallelLMHead"}
COLUMN = {"ColumnParallelLinear", "DCPGroupColumnParallelLinear"}
MERGED = {"MergedColumnParallelLinear", "DeepSeekV2FusedQkvAProjLinear"}
ROW = {"RowParallelLinear"}
REPLICATED = {"ReplicatedLinear"}
GATE = {"GateLinear", "ReplicatedLinear"}
RMS_NORM = {"RMSNorm"}
LAYER_NORM = {"LayerNorm"}
# vLLM 0.32 splits the fused MoE: `MoERunner` (router and shared experts) holds the experts'
# weights in `RoutedExperts`.
FUSED_MOE = {"FusedMoE", "SharedFusedMoE", "MoERunner"}
ROUTED_EXPERTS = {"RoutedExperts"}
MLA_OP = {"MLAAttention"}
INDEXER = {"Indexer", "DeepseekV32Indexer"}
# The CPU tree's model classes: DeepSeek-V2/V3/V3.2, Kimi-K2 and GLM-5 share `deepseek_v2.py`;
# GLM-4.7-Flash (`glm4_moe_lite.py`) subclasses its attention and reuses GLM-4.5's MoE.
MODEL = {"DeepseekV2Model", "GlmMoeDsaModel", "Glm4MoeLiteModel"}
LAYER = {"DeepseekV2DecoderLayer", "Glm4MoeLiteDecoderLayer"}
ATTENTION = {"DeepseekV2MLAAttention", "DeepseekV2Attention", "Glm4MoeLiteMLAAttention"}
# vLLM 0.32's CUDA tree (`vllm/models/deepseek_v32/`): the attention is itself the MLA op, and
# its norms, RoPE and DSA top-k run in module-level functions the probe wraps.
CUDA_MODEL = {"DeepseekV32Model"}
CUDA_LAYER = {"DeepseekV32DecoderLayer"}
CUDA_ATTENTION = {"DeepseekV32Attention"}
MOE = {"DeepseekV2MoE", "Glm4MoeLite"}
MLP = {"DeepseekV2MLP", "Glm4MoeLiteMLP", "Glm4MoeMLP"}
ROPE = {"RotaryEmbedding", "DeepseekScalingRotaryEmbedding"}
LOGITS = {"LogitsProcessor"}

# Every parameter the probe knows, after `model.layers.N.` or at the top: name pattern, the
# classes of the module that owns it. The names are those `glmcheck shards --actual` reads.
LAYER_PARAMS = [
    (r"input_layernorm\.weight", RMS_NORM),
    (r"post_attention_layernorm\.weight", RMS_NORM),
    (r"self_attn\.fused_qkv_a_proj\.weight", MERGED),
    (r"self_attn\.q_a_proj\.weight", REPLICATED),
    (r"self_attn\.kv_a_proj_with_mqa\.weight", REPLICATED),
    (r"self_attn\.q_a_layernorm\.weight", RMS_NORM),
    (r"self_attn\.kv_a_layernorm\.weight", RMS_NORM),
    (r"self_attn\.q_b_proj\.weight", COLUMN),
    # DeepSeek-V2-Lite has no q LoRA: its query comes straight from the hidden state.
    (r"self_attn\.q_proj\.weight", COLUMN),
    (r"self_attn\.kv_b_proj\.weight", COLUMN),
    (r"self_attn\.o_proj\.weight", ROW),
    (r"self_attn\.indexer\.wq_b\.weight", REPLICATED),
    (r"self_attn\.indexer\.wk_weights_proj\.weight", MERGED),
    (r"self_attn\.indexer\.k_norm\.(weight|bias)", LAYER_NORM),
    (r"mlp\.gate\.weight", GATE),
    (r"mlp\.gate\.e_score_correction_bias", GATE),
    (r"mlp\.experts\.w13_weight", FUSED_MOE),
    (r"mlp\.experts\.w2_weight", FUSED_MOE),
    (r"mlp\.experts\.routed_experts\.w13_weight", ROUTED_EXPERTS),
    (r"mlp\.experts\.routed_experts\.w2_weight", ROUTED_EXPERTS),
    (r"mlp\.shared_experts\.gate_up_proj\.weight", MERGED),
    (r"mlp\.shared_experts\.down_proj\.weight", ROW),
    (r"mlp\.gate_up_proj\.weight", MERGED),
    (r"mlp\.down_proj\.weight", ROW),
]
TOP_PARAMS = [
    (r"model\.embed_tokens\.weight", EMBED),
    (r"model\.norm\.weight", RMS_NORM),
    (r"lm_head\.weight", LM_HEAD),
]
# Parameters vLLM derives from a loaded weight after loading: listed as skipped, the weight
# they come from being checked.
ABSORBED = "MLA's absorbed up-projection, made from kv_b_proj after loading"
DERIVED = [
    (r"self_attn\.mla_attn\.mla_attn\.(W_UV|W_UK_T)", MLA_OP, ABSORBED),
    (r"self_attn\.(W_UV|W_UK_T)", CUDA_ATTENTION, ABSORBED),
]
# Quantization companions of a known weight: FP8 block scales (`weight_scale_inv`, one float
# per block) are listed, their shards checked against the plan like the weight's; per-tensor
# and activation scales are listed in the producer as skipped.
QUANT_SUFFIX = re.compile(r"(weight_scale_inv|weight_scale|input_scale|scale_inv)$")
BLOCK_SCALE = "weight_scale_inv"
FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}
LAYER_NAME = re.compile(r"^model\.layers\.([0-9]+)\.(.+)$")
# vLLM's GGUF parameters (GGUFConfig): the raw blocks under the weight's place, and the type
# beside them, which becomes a field of the weight's entry.
GGUF_WEIGHT = re.compile(r"(\.|_)qweight$")
GGUF_TYPE = re.compile(r"(\.|_)qweight_type$")

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class UnknownModel(Exception):
    """The model holds a module or parameter this probe does not know (a renamed vLLM)."""


def _model_dtype(model):
    """The model's float dtype: that of its first float parameter (GGUF `qweight`s are uint8)."""
    return next((p.dtype for p in model.parameters() if p.dtype in DTYPES), torch.float32)


def _class(module) -> str:
    return type(module).__name__


def _require(path: str, module, classes: set) -> None:
    if module is None:
        raise UnknownModel(f"{path}: missing; the probe knows vLLM's GLM-5 / DeepSeek-V2 tree")
    if _class(module) not in classes:
        raise UnknownModel(f"{path}: class {_class(module)} is not one this probe knows "
                           f"({', '.join(sorted(classes))})")


def _param_rule(name: str, num_layers: int):
    """(rule classes, the weight's name without a quantization suffix, skip reason or None)."""
    name = GGUF_WEIGHT.sub(r"\1weight", name)
    suffix = QUANT_SUFFIX.search(name)
    # `x.weight_scale_inv` and `x.input_scale` are x.weight's, `w13_weight_scale` w13_weight's.
    stem = name[:suffix.start()] + "weight" if suffix else name
    quant = suffix is not None and suffix.group(1) != BLOCK_SCALE
    m = LAYER_NAME.match(stem)
    if m:
        if int(m.group(1)) >= num_layers:
            return None, stem, "MTP layer (glmcheck's forward leaves it out)"
        rules, tail = LAYER_PARAMS, m.group(2)
    else:
        rules, tail = TOP_PARAMS, stem
    for pattern, classes in rules:
        if re.fullmatch(pattern, tail):
            return classes, stem, "quantization scale" if quant else None
    for pattern, classes, why in DERIVED if rules is LAYER_PARAMS else ():
        if re.fullmatch(pattern, tail):
            return classes, stem, why
    return None, stem, None


def _config(model):
    cfg = getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)
    if cfg is None:
        raise UnknownModel("model: no `config` on the model or `model.model`; pass the "
                           "GlmMoeDsaForCausalLM / DeepseekV2ForCausalLM vLLM loaded")
    return cfg


def _vllm_version():
    mod = sys.modules.get("vllm")
    return getattr(mod, "__version__", None)
