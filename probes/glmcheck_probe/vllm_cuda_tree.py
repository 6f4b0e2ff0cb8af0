"""vLLM 0.32's CUDA model tree for GLM-5 / DeepSeek-V3.2 (`vllm/models/deepseek_v32/nvidia/`:
`DeepseekV32Model`, `DeepseekV32DecoderLayer`, `DeepseekV32Attention`), built on vLLM's CPU
build: with `GLMCHECK_VLLM_TREE=cuda` (`vllm_capture --tree cuda` sets it) the plugin registers
that tree for `GlmMoeDsaForCausalLM` and `DeepseekV32ForCausalLM` in place of the CPU tree
vLLM picks on a CPU, and stands in for its GPU kernels only. Its loaders, parameters, sharding,
collectives (the un-reduced o_proj and MoE outputs, the all-reduce folded into the next
RMSNorm), MoE and linear layers stay vLLM's.

Each stand-in follows the arithmetic of the kernel it replaces, in float32 (`dsa_ops`):

* `vllm/model_executor/layers/fused_embed_norm.py` `fused_embed_norm` (Triton): the embedding
  rows and, chained, the first layer's input RMSNorm of them;
* `vllm/models/deepseek_v32/common/kernels.py` `fused_norm_rope` (Triton): RMSNorm of q_c and
  kv_c, interleaved RoPE of k_pe, the MLA latent cache written at the slot mapping, the top-k
  buffer cleared, and the indexer's key (LayerNorm, then RoPE, NeoX unless
  `indexer_rope_interleave`), which the kernel writes FP8-quantized into the indexer's cache:
  here it is handed unquantized to the indexer stand-in below;
* the same file's `fused_q` (Triton or CuTeDSL): interleaved RoPE of q_pe, RoPE of the
  indexer's query (not FP8-quantized, so its scale is 1) and its head weights times the softmax
  and head-count scales;
* `vllm/model_executor/layers/sparse_attn_indexer.py` `sparse_attn_indexer` (DeepGEMM's FP8 MQA
  logits and top-k): `dsa_ops.dsa_topk` over each sequence's causal keys;
* the choice of a dense-MHA prefill for short prompts (`MLAAttention._use_sparse_mha`, a
  property of the CUDA attention backends): every prefill takes the top-k MQA path below, as
  with `sparse_mla_force_mqa`;
* FlashMLA's sparse decode behind `impl.forward_mqa` in `DeepseekV32Attention`
  (`vllm/models/deepseek_v32/attention.py`): latent attention over the MLA cache's entries of
  the prompt at the indexer's keys; the output goes through vLLM's own `W_UV` as on a GPU.

`fused_allreduce_rms_norm` (`vllm/models/common/ops/fused_allreduce_rms_norm.py`) needs no stand-in:
without FlashInfer it all-reduces and calls the RMSNorm module. Whole-prompt prefills only, as
for the CPU tree's stand-ins.
"""

import os

import torch

from . import dsa_ops
from .vllm_plugin import sequences

TREE_ENV = "GLMCHECK_VLLM_TREE"
CUDA_TREE = "vllm.models.deepseek_v32.nvidia.model:DeepseekV32ForCausalLM"
# The indexer key `fused_norm_rope` made, waiting for the `sparse_attn_indexer` call of the
# same layer (the two run one after the other in `DeepseekV32Attention.forward`).
_pending = {}


def wanted() -> bool:
    tree = os.environ.get(TREE_ENV, "")
    if tree not in ("", "cpu", "cuda"):
        raise ValueError(f"{TREE_ENV}={tree!r}: give cpu or cuda")
    return tree == "cuda"


def install() -> None:
    from vllm import ModelRegistry
    from vllm.models.deepseek_v32 import attention
    from vllm.models.deepseek_v32.nvidia import model
    from vllm.v1.attention.backends.mla import cpu_mla

    for arch in ("GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"):
        ModelRegistry.register_model(arch, CUDA_TREE)
    model.fused_embed_norm = fused_embed_norm
    attention.fused_norm_rope = fused_norm_rope
    attention.fused_q = fused_q
    attention.sparse_attn_indexer = sparse_attn_indexer
    attention.DeepseekV32Attention._use_sparse_mha = lambda self, attn_metadata: False
    cpu_mla.CPUMLAImpl.forward_mqa = _sparse_forward_mqa(cpu_mla.CPUMLAImpl.forward_mqa)


def fused_embed_norm(input_ids, embed_table, chain_weight=None, eps=0.0):
    rows = embed_table[input_ids]
    if chain_weight is None:
        return rows
    return rows, dsa_ops.rms_norm(rows, chain_weight, eps).to(rows.dtype)


def fused_norm_rope(positions, q_c, q_rms_norm_w, q_rms_eps, kv_c, kv_rms_norm_w, kv_rms_eps,
                    k_pe, k_rope_cos_sin_cache, index_k, index_k_layer_norm_w,
                    index_k_layer_norm_bias, index_k_layer_norm_eps, index_k_rope_cos_sin_cache,
                    topk_indices_buffer, slot_mapping=None, indexer_slot_mapping=None,
                    indexer_k_cache=None, indexer_cache_shuffled=False, mla_kv_cache=None,
                    mla_kv_cache_dtype="auto", mla_k_scale=None, has_indexer=True,
                    index_rope_interleave=False, q_c_out=None, kv_c_out=None, k_pe_out=None,
                    index_k_out=None):
    t = positions.shape[0]
    q_c_out = torch.empty_like(q_c) if q_c_out is None else q_c_out
    q_c_out.copy_(dsa_ops.rms_norm(q_c, q_rms_norm_w, q_rms_eps))
    kv = dsa_ops.rms_norm(kv_c, kv_rms_norm_w, kv_rms_eps)
    pe = dsa_ops.rope(k_pe, k_rope_cos_sin_cache, positions, interleaved=True)
    if kv_c_out is not None:
        kv_c_out.copy_(kv)
    if k_pe_out is not None:
        k_pe_out.copy_(pe)
    if mla_kv_cache is not None and slot_mapping is not None and mla_kv_cache.numel():
        if mla_kv_cache_dtype != "auto":
            raise NotImplementedError(f"glmcheck's CPU stand-in writes the MLA cache in the "
                                      f"model's dtype, not {mla_kv_cache_dtype}")
        flat = mla_kv_cache.view(-1, kv.shape[-1] + pe.shape[-1])
        slots = slot_mapping[:t].long()
        valid = slots >= 0
        flat[slots[valid]] = torch.cat((kv, pe), dim=-1)[valid].to(flat.dtype)
    if has_indexer:
        topk_indices_buffer[:t] = -1
        key = dsa_ops.layer_norm(index_k, index_k_layer_norm_w, index_k_layer_norm_bias,
                                 index_k_layer_norm_eps)
        key = dsa_ops.rope(key, index_k_rope_cos_sin_cache, positions,
                           interleaved=index_rope_interleave)
        if index_k_out is not None:
            index_k_out.copy_(key)
        _pending["index_k"] = key
    return q_c_out


def fused_q(positions, q_pe, q_pe_cos_sin_cache, index_q, index_q_cos_sin_cache, ql_nope,
            q_scale, index_weights, index_weights_softmax_scale, index_weights_head_scale,
            has_indexer=True, index_rope_interleave=False, quantize_mqa=True):
    if quantize_mqa:
        raise NotImplementedError("glmcheck's CPU stand-in has no FP8 MLA query (FlashInfer's "
                                  "sparse backend); the CPU MLA backend asks for none")
    mqa_q = dsa_ops.rope(q_pe, q_pe_cos_sin_cache, positions, interleaved=True).to(q_pe.dtype)
    if not has_indexer:
        return None, None, mqa_q
    index_q = dsa_ops.rope(index_q, index_q_cos_sin_cache, positions,
                           interleaved=index_rope_interleave)
    weights = (index_weights.float() * index_weights_softmax_scale
               * index_weights_head_scale)
    return index_q, weights, mqa_q


def sparse_attn_indexer(hidden_states, k_cache_prefix, kv_cache, q_quant, q_scale, k, weights,
                        quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len,
                        total_seq_lens, topk_indices_buffer, *args, **kwargs):
    key = _pending.pop("index_k", None) if k is None else k
    if key is None:
        raise RuntimeError("glmcheck's CPU stand-in for sparse_attn_indexer: no indexer key "
                           "from fused_norm_rope for this layer")
    t = hidden_states.shape[0]
    return dsa_ops.dsa_topk(q_quant.reshape(t, -1, head_dim), key, weights.reshape(t, -1),
                            topk_tokens, sequences(t), topk_indices_buffer)


def _sparse_forward_mqa(dense):
    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        chosen = getattr(layer, "topk_indices_buffer", None)
        if chosen is None or not isinstance(q, tuple):
            return dense(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)
        ql_nope, q_pe = q
        t = ql_nope.shape[0]
        flat = kv_c_and_k_pe_cache.view(-1, self.kv_lora_rank + q_pe.shape[-1])
        entries = flat[attn_metadata.slot_mapping[:t].long()]
        kv_c, k_pe = entries.split([self.kv_lora_rank, q_pe.shape[-1]], dim=-1)
        latent = dsa_ops.sparse_latent_attention(ql_nope, q_pe, kv_c, k_pe, chosen, self.scale,
                                                 sequences(t))
        return latent.to(ql_nope.dtype), None

    return forward_mqa
