"""GLM-5's feed-forward modules as SGLang 0.5.23 builds them on TP without EP
(models/deepseek_v2.py, "dv2" below): the dense layers' DeepseekV2MLP and the MoE layers'
DeepseekV2MoE (gate, topk, experts, shared_experts), each returning this rank's partial sum.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from glmcheck_oracle.sglang.layers import Linear, SiluAndMul

class MLP(nn.Module):
    """DeepseekV2MLP (dv2:283): `mlp(x, forward_batch, allocator)`; gate_up_proj, act_fn,
    down_proj; its output is this rank's partial sum (reduce_results=False, dv2:2674, 318)."""

    def __init__(self, w):
        super().__init__()
        self.gate_up_proj = Linear(w["gate_up_proj"])
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(w["down_proj"])

    def forward(self, x, forward_batch=None, gemm_output_zero_allocator=None,
                gateup_pre_quant=None):
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class MoEGate(nn.Module):
    """dv2:497: logits = x · W^T in f32 from a weight in the model dtype (dv2:514, 593);
    the correction bias in f32 (dv2:520)."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, hidden_states, gemm_output_zero_allocator=None, forward_batch=None):
        return F.linear(hidden_states.float(), self.weight.float())


class StandardTopKOutput(NamedTuple):
    """layers/moe/topk.py:363: a NamedTuple, so the dumper splits it into .0, .1, .2."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


class TopK(nn.Module):
    """layers/moe/topk.py:1780 biased_grouped_topk_impl: sigmoid scores, choice by score + bias
    within the best groups (sum of each group's top 2), weights renormalized; the routed
    scaling factor is left to the experts (dv2:761, 797)."""

    def __init__(self, cfg, bias, fault):
        super().__init__()
        self.k, self.groups, self.topk_group = (cfg["num_experts_per_tok"], cfg["n_group"],
                                                cfg["topk_group"])
        self.renormalize, self.bias, self.fault = cfg["norm_topk_prob"], bias, fault
        self.fused = cfg.get("num_fused_shared_experts", 0)
        self.scale = cfg["routed_scaling_factor"]

    def forward(self, hidden_states, router_logits):
        scores = (router_logits.softmax(-1) if self.fault == "router-softmax"
                  else router_logits.sigmoid())
        choice = scores + self.bias
        t, e = choice.shape
        grouped = choice.view(t, self.groups, e // self.groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1)
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        choice = choice.masked_fill(~keep.repeat_interleave(e // self.groups, 1), float("-inf"))
        if self.fused:
            return self._fused(scores, choice, e, router_logits)
        ids = choice.topk(self.k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return StandardTopKOutput(weights, ids.to(torch.int32), router_logits)

    def _fused(self, scores, choice, e, router_logits):
        """The same router with the shared expert fused (--fuse-shared-experts), as
        biased_grouped_topk_impl does with num_fused_shared_experts=1 (topk.py:1817-1853):
        top_k = k + 1 (topk.py:733, dv2:703) chosen sorted, the last column's id overwritten
        with the shared expert's, n_routed_experts (:1826-1833, randint over [e, e+1)), the
        routed weights renormalized over the routed columns only (:1836-1844), and the last
        column's weight 1/routed_scaling_factor (:1848-1852, fused_shared_expert_weight
        :2473, the factor not being applied in top-k for the unquantized Triton runner), so
        that the experts' final scaling makes the shared expert's weight 1. GLM-5's 256
        experts at top-k 9 take the JIT router instead (topk.py:2175-2183), which writes the
        same columns (kernels/ops/moe/moe_fused_gate.py:297-302)."""
        ids = choice.topk(self.k + self.fused, dim=-1, sorted=True)[1]
        weights = scores.gather(1, ids)
        ids[:, -1] = e
        if self.renormalize:
            weights = weights / weights[:, :-1].sum(-1, keepdim=True)
        weights[:, -1] = 1.0 / self.scale
        return StandardTopKOutput(weights.float(), ids.to(torch.int32), router_logits)


class UnquantizedFusedMoEMethod(nn.Module):
    """quantization/unquant.py:757: holds no weights (they are the FusedMoE's); here only
    its place in the module tree."""


class FusedMoE(nn.Module):
    """layers/moe/fused_moe_triton: `experts(x, topk_output)`, each expert's intermediate
    dim split over TP; routed_scaling_factor applied in the final reduce
    (moe_runner/triton.py:111), so the output is scale·Σ w·expert(x), a partial sum.
    Unquantized, its `quant_method` is an UnquantizedFusedMoEMethod, an nn.Module
    (quantization/unquant.py:757, a BaseFusedOp) and so a child (fused_moe_triton/layer.py:502)
    that is never called as a module (`.apply` → `self.forward`, unquant.py:1231): `experts`
    is not a leaf, which tensor_dump_forward_hook.py's leaf-only hooks see."""

    def __init__(self, w13, w2, scale):
        super().__init__()
        self.w13_weight = nn.Parameter(w13, requires_grad=False)
        self.w2_weight = nn.Parameter(w2, requires_grad=False)
        self.scale = scale
        self.quant_method = UnquantizedFusedMoEMethod()

    def forward(self, hidden_states, topk_output):
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)
        for slot in range(topk_output.topk_ids.shape[1]):
            for e in topk_output.topk_ids[:, slot].unique().tolist():
                rows = (topk_output.topk_ids[:, slot] == e).nonzero()[:, 0]
                gate_up = F.linear(hidden_states[rows], self.w13_weight[e])
                d = gate_up.shape[-1] // 2
                act = (F.silu(gate_up[:, :d].float()) * gate_up[:, d:].float()).to(gate_up.dtype)
                y = F.linear(act, self.w2_weight[e]).float()
                out[rows] += y * topk_output.topk_weights[rows, slot, None]
        return (out * self.scale).to(hidden_states.dtype)


class MoE(nn.Module):
    """DeepseekV2MoE.forward_normal (dv2:1300): shared experts first (the runner is
    in-place, moe_runner/base.py:57, so defer_shared is False, dv2:1315), gate, topk, experts, then
    routed + shared (mxfp4_flashinfer_trtllm_moe.py:569), a partial sum (reduce_results=False,
    dv2:2662, 1292)."""

    def __init__(self, w, cfg, fault):
        super().__init__()
        self.gate = MoEGate(w["gate"], w["bias"])
        self.topk = TopK(cfg, self.gate.e_score_correction_bias, fault)
        self.experts = FusedMoE(w["w13"], w["w2"], cfg["routed_scaling_factor"])
        # Fused (--fuse-shared-experts): no shared_experts module (dv2:862-869, the
        # attribute stays None), the shared expert being `experts`' last expert.
        self.shared_experts = MLP(w["shared"]) if "shared" in w else None
        self.fault, self.scale = fault, cfg["routed_scaling_factor"]

    def forward(self, hidden_states, forward_batch=None, gemm_output_zero_allocator=None):
        shared = None
        if self.shared_experts is not None:  # dv2:1745 _forward_shared_experts
            shared = self.shared_experts(hidden_states,
                                         gemm_output_zero_allocator=gemm_output_zero_allocator)
        router_logits = self.gate(hidden_states, gemm_output_zero_allocator)
        topk_output = self.topk(hidden_states, router_logits)
        routed = self.experts(hidden_states, topk_output)
        if self.fault == "routed-scale-twice":
            routed = routed * self.scale
        # mxfp4_flashinfer_trtllm_moe.py:569-571: with no shared output, routed as it is.
        return routed if shared is None else routed + shared
