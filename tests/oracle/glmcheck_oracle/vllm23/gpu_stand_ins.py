"""Torch stand-ins for the GPU kernels a GLM-5 GGUF forward calls in vLLM 0.23, so that vLLM's
own model code runs that forward on the CPU build.

Each stand-in replaces one kernel and nothing around it: the modules, their weights as vLLM's
loaders sharded them, the sharding, the collectives, RMSNorm, RoPE, the router and every
projection's Python code stay vLLM's. What is replaced, and the vLLM file that calls it:

* the GGUF kernels of `vllm/_custom_ops.py` (`ggml_dequantize`, `ggml_mul_mat_vec_a8`,
  `ggml_mul_mat_a8`, `ggml_moe_a8_vec`, and `moe_sum` of `_moe_C`), called from
  `vllm/model_executor/layers/quantization/gguf.py`: glmcheck's stand-ins
  (`glmcheck_probe.gguf_kernels`, gguf-py's dequantization, no Q8_1 rounding of the
  activation);
* `SparseAttnIndexer` (`vllm/model_executor/layers/sparse_attn_indexer.py`, DeepGEMM's FP8 MQA
  logits and top-k): the DSA scores Σ_h w·relu(q·k) over the causal keys and their top-k, in
  float32; and `per_token_group_quant_fp8` in `deepseek_v2.py` leaves the indexer's q
  unquantized (scale 1), so the FP8 rounding of q and k is not reproduced;
* the sparse MLA kernel (FlashMLA's, behind `MLAAttention.forward` in
  `vllm/model_executor/layers/attention/mla_attention.py`): attention over the latent cache at
  the indexer's keys, with q's nope part absorbed through vLLM's own `W_UK_T` and the output
  through its own `_v_up_proj` (`W_UV`), both made by vLLM's `process_weights_after_loading`
  from the rank's `kv_b_proj`. As on the GPU, `kv_b_proj` itself is not called in the forward.

Faults, each a bug of the kind a deployment hits, put in place of the piece it breaks:

* `q4k-high-scales`: the GGUF dequantization unpacks Q4_K's scales and mins of sub-blocks 4..7
  without their two high bits (the low nibble only);
* `fp16-no-residual-rescale`: the decoder layer's fp16 guard scales the attention output by
  1/routed_scaling_factor but not the residual stream at layer 0
  (`DeepseekV2DecoderLayer.forward` in `deepseek_v2.py`), so the two are summed in different
  units.
"""

import gguf
import numpy as np
import torch
from glmcheck_probe import dsa_ops, gguf_kernels

FAULTS = ("q4k-high-scales", "fp16-no-residual-rescale")
_installed = None


def dequantize_q4_k(data: np.ndarray, high_scales: bool = True) -> np.ndarray:
    """Q4_K blocks (144 bytes: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of
    nibbles) to float32 values, 256 per block. `high_scales=False` is the planted bug: the
    scales and mins of sub-blocks 4..7 keep only their low four bits."""
    blocks = data.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)
    s = blocks[:, 4:16].astype(np.uint16)
    qs = blocks[:, 16:144]
    scale = np.empty((len(blocks), 8), np.float32)
    mins = np.empty((len(blocks), 8), np.float32)
    scale[:, :4] = s[:, 0:4] & 63
    mins[:, :4] = s[:, 4:8] & 63
    high = 1 if high_scales else 0
    scale[:, 4:] = (s[:, 8:12] & 15) | (((s[:, 0:4] >> 6) << 4) * high)
    mins[:, 4:] = (s[:, 8:12] >> 4) | (((s[:, 4:8] >> 6) << 4) * high)
    # 32 bytes per pair of sub-blocks: low nibbles are the first, high nibbles the second.
    q = qs.reshape(-1, 4, 32)
    nib = np.stack([q & 15, q >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)
    out = d[:, None, None] * scale[:, :, None] * nib - dmin[:, None, None] * mins[:, :, None]
    return out.reshape(-1)


class Kernels(gguf_kernels.Kernels):
    """glmcheck's GGUF kernel stand-ins, with the planted dequantization fault if asked."""

    def __init__(self, fault: str | None):
        self.fault = fault

    def values(self, raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        if qtype == gguf.GGMLQuantizationType.Q4_K and self.fault == "q4k-high-scales":
            return dequantize_q4_k(raw.reshape(-1), high_scales=False)
        return super().values(raw, qtype)


def _indexer_topk(self, hidden_states, q, k, weights):
    """DSA top-k over the causal keys of the one prompt, into vLLM's `topk_indices_buffer`
    (glmcheck's plugin's arithmetic, `dsa_ops.dsa_topk`)."""
    t = hidden_states.shape[0]
    return dsa_ops.dsa_topk(q.reshape(t, -1, self.head_dim), k, weights, self.topk_tokens,
                            [(0, t)], self.topk_indices_buffer)


def _sparse_mla(self, q, kv_c_normed, k_pe, output_shape=None):
    """FlashMLA's sparse attention over the one prompt (`dsa_ops.sparse_latent_attention`):
    q's nope part absorbed through vLLM's W_UK_T, the output through its _v_up_proj."""
    t = q.shape[0]
    q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)
    latent = dsa_ops.sparse_latent_attention(ql_nope, q_pe, kv_c_normed, k_pe.reshape(t, -1),
                                             self.indexer.topk_indices_buffer, self.scale,
                                             [(0, t)])
    out = torch.empty(output_shape, dtype=q.dtype)
    self._v_up_proj(latent.to(q.dtype).contiguous(), out=out)
    return out


def _no_residual_rescale(original):
    """`DeepseekV2DecoderLayer.forward` whose fp16 guard skips the residual at layer 0: the
    guard scales the residual only `if self.layer_idx == 0`, so layer 0 runs with another
    index (the forward reads `layer_idx` nowhere else)."""

    def forward(self, *args, **kwargs):
        if self.layer_idx != 0:
            return original(self, *args, **kwargs)
        self.layer_idx = -1
        try:
            return original(self, *args, **kwargs)
        finally:
            self.layer_idx = 0

    return forward


def install(fault: str | None = None) -> Kernels:
    """Put the stand-ins in place (once per process), with `fault` if given."""
    global _installed
    if fault not in (None,) + FAULTS:
        raise ValueError(f"fault {fault!r}: one of {FAULTS}")
    if _installed is not None:
        return _installed
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import sparse_attn_indexer
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.model_executor.models import deepseek_v2

    kernels = Kernels(fault)
    kernels.install(ops)
    indexer = sparse_attn_indexer.SparseAttnIndexer
    indexer.forward_native = indexer.forward_cpu = _indexer_topk
    deepseek_v2.per_token_group_quant_fp8 = (
        lambda x, group, **kw: (x, torch.ones(x.shape[0], 1, dtype=torch.float32)))
    mla_attention.MLAAttention.forward = _sparse_mla
    if fault == "fp16-no-residual-rescale":
        layer = deepseek_v2.DeepseekV2DecoderLayer
        layer.forward = _no_residual_rescale(layer.forward)
    _installed = kernels
    return kernels
