"""Torch arithmetic of the DeepSeek-Sparse-Attention pieces that vLLM runs as GPU kernels: the
DSA indexer's top-k, sparse attention in MLA's latent space, and the norms and rotations that
vLLM's CUDA model tree fuses into Triton kernels. The plugin's stand-ins for both of vLLM's
GLM-5 trees (`vllm_plugin`, `vllm_cuda_tree`) compute with these, in float32, on whole-prompt
prefills given as (start, end) spans of the batch's tokens.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x · rsqrt(mean(x²) + eps)) · weight in float32, as the fused norm kernels compute it
    (`vllm/models/deepseek_v32/common/kernels.py` `_rms_norm`)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
               eps: float) -> torch.Tensor:
    """LayerNorm over the last axis in float32 (the indexer's key norm)."""
    x = x.float()
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * weight.float() + bias.float()


def rope(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
         interleaved: bool) -> torch.Tensor:
    """`x` [t, ..., d] rotated over its first `cos_sin_cache.shape[-1]` dims, in float32:
    pairs (2i, 2i+1) when `interleaved`, else (i, i + half) (NeoX). The cache holds
    cos | sin per position, as vLLM's rotary embeddings do."""
    x = x.float()
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cos, sin = cos_sin_cache[positions].float().split(half, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    head, tail = x[..., :rot], x[..., rot:]
    if interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    else:
        a, b = head[..., :half], head[..., half:]
        turned = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    return torch.cat((turned, tail), dim=-1)


def dsa_topk(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int, spans,
             out: torch.Tensor) -> torch.Tensor:
    """DSA top-k over each sequence's causal keys into `out` [t, topk]: scores
    Σ_h weights·relu(q·k) for q [t, h, d], k [t, d], weights [t, h] (the softmax and head-count
    scales already in `weights`), as key positions within the sequence, -1 where a query has
    fewer keys than `topk`."""
    q, k, weights = q.float(), k.float(), weights.float()
    t = q.shape[0]
    out[:t] = -1
    for a, b in spans:
        n = b - a
        scores = torch.einsum("thd,sd->tsh", q[a:b], k[a:b]).relu()
        scores = (scores * weights[a:b].unsqueeze(1)).sum(-1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        width = min(topk, n)
        values, ids = scores.topk(width, dim=-1)
        out[a:b, :width] = torch.where(torch.isinf(values), -1, ids).to(out.dtype)
    return out


def sparse_latent_attention(ql_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                            k_pe: torch.Tensor, chosen: torch.Tensor, scale: float,
                            spans) -> torch.Tensor:
    """MLA attention in the latent space at the chosen keys, float32 [t, h, kv_lora_rank]:
    ql_nope [t, h, l] (q's nope part through W_UK_T), q_pe [t, h, r] rotated, kv_c [t, l]
    normed, k_pe [t, r] rotated, `chosen` [t, topk] key positions within each sequence (-1:
    none)."""
    t, heads = ql_nope.shape[:2]
    latent = torch.zeros(t, heads, kv_c.shape[-1], dtype=torch.float32)
    chosen = chosen[:t].long()
    for a, b in spans:
        n = b - a
        scores = (torch.einsum("thl,sl->ths", ql_nope[a:b].float(), kv_c[a:b].float())
                  + torch.einsum("thr,sr->ths", q_pe[a:b].float(), k_pe[a:b].float()))
        ids = chosen[a:b]
        allowed = torch.zeros(n, n, dtype=torch.bool)
        valid = ids >= 0
        rows = torch.arange(n).unsqueeze(1).expand_as(ids)
        allowed[rows[valid], ids[valid]] = True
        probs = (scores * scale).masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1)
        latent[a:b] = torch.einsum("ths,sl->thl", probs, kv_c[a:b].float())
    return latent
