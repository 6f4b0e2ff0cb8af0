"""The SGLang 0.5.23 building blocks the family's modules are made of (sglang/srt/layers/), in
plain torch on this rank's shards, each called and returning as SGLang's does, since the
dumper's hooks record exactly those arguments and return values. TP collectives go over the
gloo world that dump.py starts, which is the TP group.
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

def tp() -> tuple:
    """(rank, size) of the TP group, the whole gloo world."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The TP group's sum (in f32 over gloo; SGLang's NCCL/custom all-reduce sums in bf16)."""
    if tp()[1] == 1:
        return x
    y = x.float()
    dist.all_reduce(y)
    return y.to(x.dtype)


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' blocks along the last dim, in rank order."""
    if tp()[1] == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp()[1])]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


class Linear(nn.Module):
    """ReplicatedLinear / ColumnParallelLinear / RowParallelLinear with this rank's weight
    shard: called as `proj(x)`, returns `(output, bias=None)` (layers/linear.py). The row
    parallel ones here all have reduce_results=False (dv2:2639 → 2159 o_proj, 2674 → 318
    down_proj)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x):
        return F.linear(x.to(self.weight.dtype), self.weight), None


class RMSNorm(nn.Module):
    """layers/layernorm.py:518 forward_cuda(x, residual=None, post_residual_addition=None):
    alone the norm; with a residual the fused add (x + residual) and its norm, returned as
    (normed, new residual)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def _norm(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)

    def forward(self, x, residual=None, post_residual_addition=None):
        if residual is None:
            return self._norm(x)
        summed = (x.float() + residual.float()).to(x.dtype)
        return self._norm(summed), summed


class LayerNorm(nn.Module):
    """The indexer's k_norm: a LayerNorm with f32 parameters (dsa_indexer.py:378)."""

    def __init__(self, weight, bias, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.bias = nn.Parameter(bias.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x):
        return F.layer_norm(x.float(), x.shape[-1:], self.weight, self.bias, self.eps).to(x.dtype)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """rotary_embedding/yarn.py:60 (and configs/model_config.py:2617)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(rope_scaling, base: float) -> float:
    """configs/model_config.py:2623 compute_mla_mscale_scaling, which the MLA attention applies
    whenever it has a rope_scaling (dv2:2177-2178), by then renamed deepseek_yarn: the base
    scale × yarn_get_mscale(factor, mscale_all_dim)², mscale_all_dim absent being 0, a factor
    absent 1."""
    if not (rope_scaling.get("apply_yarn_scaling", True)
            and rope_scaling.get("apply_scale", True)):
        return base
    m = yarn_get_mscale(rope_scaling.get("factor", 1.0),
                        float(rope_scaling.get("mscale_all_dim", False)))
    return base * m * m


def _yarn(rotary_dim, base, max_position, s):
    """DeepseekScalingRotaryEmbedding (rotary_embedding/rope_variant.py:335), which every
    rope_scaling of the MLA attention becomes (`deepseek_yarn`, factory.py:371-401 passing
    these keys): the frequencies blended between interpolated and
    extrapolated over YaRN's correction range (:380-404, yarn.py:14-51), and cos/sin ×
    yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) × attn_factor
    (:364-368, :414-415)."""
    factor = s.get("factor", 1.0)
    original = s.get("original_max_position_embeddings", max_position)

    def correction_dim(rotations):
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(s.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(s.get("beta_slow", 1))), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float) - low) / (high - low)).clamp(0, 1)
    extrapolate = (1 - ramp) * s.get("extrapolation_factor", 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    mscale = (yarn_get_mscale(factor, float(s.get("mscale", 1)))
              / yarn_get_mscale(factor, float(s.get("mscale_all_dim", 0)))
              * s.get("attn_factor", 1))
    return inv_freq, mscale


class RotaryEmbedding(nn.Module):
    """rotary_embedding/base.py:321: `rotary_emb(positions, q, k)` rotates the first
    `rotary_dim` of each head and returns `(q, k)`; GPT-J pairs (x0,x1),(x2,x3)... rotated in
    place when not `is_neox_style`, halves (x_i, x_{i+d/2}) when it is. With the config's
    `rope_scaling` it is DeepSeek's YaRN (`_yarn`)."""

    def __init__(self, rotary_dim: int, cfg: dict, is_neox_style: bool, dtype):
        super().__init__()
        self.rotary_dim, self.is_neox_style = rotary_dim, is_neox_style
        base = cfg["rope_theta"]
        if cfg["rope_scaling"]:
            self.inv_freq, self.mscale = _yarn(rotary_dim, base, cfg["max_position_embeddings"],
                                               cfg["rope_scaling"])
        else:
            self.inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
            self.mscale = 1.0
        self.dtype = dtype

    def rotate(self, positions, x):
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        cos = (angles.cos() * self.mscale).to(self.dtype)
        sin = (angles.sin() * self.mscale).to(self.dtype)
        shape = x.shape
        x = x.reshape(shape[0], -1, shape[-1])
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([rot, rest], dim=-1).reshape(shape)

    def forward(self, positions, query, key):
        return self.rotate(positions, query), self.rotate(positions, key)


class SiluAndMul(nn.Module):
    """layers/activation.py SiluAndMul: silu(x[:, :d]) * x[:, d:]."""

    def forward(self, x):
        d = x.shape[-1] // 2
        return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


class RadixAttention(nn.Module):
    """layers/radix_attention.py: `attn_mha(q, k, v, forward_batch, save_kv_cache=False,
    key_value_num_tokens=...)` (forward_mha.py:305) → [T, heads·v_head_dim]; causal, the
    queries being the last T of the keys. `attn_mqa` (the absorbed MLA path) is built, as in
    SGLang (dv2:2183), and never called on this path."""

    def __init__(self, scaling: float):
        super().__init__()
        self.scaling = scaling

    def forward(self, q, k, v, forward_batch, save_kv_cache=True, key_value_num_tokens=None):
        tq, tk = q.shape[0], k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * self.scaling
        causal = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
        return out.reshape(tq, -1)
