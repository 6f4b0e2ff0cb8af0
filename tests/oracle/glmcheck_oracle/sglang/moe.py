"""The family's feed-forward modules as SGLang 0.5.23 builds them on TP without EP
(models/deepseek_v2.py, "dv2" below): the dense layers' DeepseekV2MLP and the MoE layers'
DeepseekV2MoE (gate, topk, experts, shared_experts), each returning this rank's partial sum;
GLM-4.7-Flash's Glm4MoeLiteMLP and Glm4MoeLiteSparseMoeBlock (glm4_moe_lite.py:98, :173) have
the same children, called with the same tensors, and differ only in the gate's dtype.
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
    """dv2:497: logits = x · W^T in f32 (dv2:593) from the weight as loaded (weights.py: the
    model dtype, or f32 for GLM-4.7-Flash's Glm4MoeLiteGate, glm4_moe_lite.py:150-170); the
    correction bias in f32 (dv2:520), None without noaux_tc."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.e_score_correction_bias = (None if bias is None else
                                        nn.Parameter(bias.float(), requires_grad=False))

    def forward(self, hidden_states, gemm_output_zero_allocator=None, forward_batch=None):
        return F.linear(hidden_states.float(), self.weight.float())


class StandardTopKOutput(NamedTuple):
    """layers/moe/topk.py:363: a NamedTuple, so the dumper splits it into .0, .1, .2."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    router_logits: torch.Tensor


class TopK(nn.Module):
    """layers/moe/topk.py:2934-2962 select_experts with use_grouped_topk, which every member
    asks for whatever its topk_method (dv2:786-797, glm4_moe_lite.py:223-233). Without a
    correction bias (V2, V2-Lite), grouped_topk_gpu (:1384): softmax or sigmoid scores, groups
    ranked by their best score, the others' scores zeroed, the top-k scores the weights. With
    one, biased_grouped_topk_impl (:1780; the CUDA kernels compute the same): sigmoid scores
    whatever scoring_func, groups ranked by the sum of their two best biased scores, the others
    -inf, the choice by biased score and the weights the unbiased scores. Either way the
    weights renormalized over the routed columns when norm_topk_prob (+1e-20, :158), and the
    routed scaling factor left to the experts (dv2:761, 797)."""

    def __init__(self, cfg, bias, fault):
        super().__init__()
        self.k, self.groups, self.topk_group = (cfg["num_experts_per_tok"], cfg["n_group"],
                                                cfg["topk_group"])
        self.renormalize, self.bias, self.fault = cfg["norm_topk_prob"], bias, fault
        self.scoring = cfg.get("scoring_func", "softmax") if bias is None else "sigmoid"
        self.fused = cfg.get("num_fused_shared_experts", 0)
        self.scale = cfg["routed_scaling_factor"]

    def forward(self, hidden_states, router_logits):
        scoring = "softmax" if self.fault == "router-softmax" else self.scoring
        scores = router_logits.softmax(-1) if scoring == "softmax" else router_logits.sigmoid()
        t, e = scores.shape
        if self.bias is None:
            choice, group_scores = scores, scores.view(t, self.groups, -1).max(-1).values
            outside = 0.0
        else:
            choice = scores + self.bias
            group_scores = choice.view(t, self.groups, -1).topk(2, dim=-1)[0].sum(-1)
            outside = float("-inf")
        if self.fault != "group-limit-ignored":
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
            choice = choice.masked_fill(~keep.repeat_interleave(e // self.groups, 1), outside)
        # The fused shared expert's column comes last: the choice sorted (:1425, :1822).
        values, ids = choice.topk(self.k + self.fused, dim=-1, sorted=self.fused > 0)
        weights = values if self.bias is None else scores.gather(1, ids)
        routed = weights[:, : self.k]
        if self.renormalize:
            routed = routed / (routed.sum(-1, keepdim=True) + 1e-20)
        if self.fused:
            return self._fused(routed, ids, e, router_logits)
        return StandardTopKOutput(routed.float(), ids.to(torch.int32), router_logits)

    def _fused(self, routed, ids, e, router_logits):
        """The shared expert fused (--fuse-shared-experts): top_k = k + 1 (topk.py:733,
        dv2:703), the last column's id overwritten with the shared expert's, n_routed_experts
        (:1427-1433, :1826-1833, randint over [e, e+1)), the routed weights renormalized over
        the routed columns only (:1440-1449, :1835-1844), and the last column's weight
        1/routed_scaling_factor (grouped :1435-1438 before renormalizing by the routed sum,
        biased :1848-1852 with fused_shared_expert_weight :2473, the factor not being applied
        in top-k for the unquantized Triton runner), so that the experts' final scaling makes
        the shared expert's weight 1. GLM-5's 256 experts at top-k 9 take the JIT router
        instead (topk.py:2175-2183), which writes the same columns
        (kernels/ops/moe/moe_fused_gate.py:297-302)."""
        ids = ids.clone()
        ids[:, -1] = e
        shared = torch.full_like(routed[:, :1], 1.0 / self.scale)
        weights = torch.cat([routed, shared], dim=-1)
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
