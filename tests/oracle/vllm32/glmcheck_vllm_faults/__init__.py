"""Bugs planted inside vLLM 0.32's own code, for glmcheck's tests: a vLLM general plugin that
does nothing unless `GLMCHECK_VLLM_FAULT` names one of `FAULTS`. vLLM loads it in every process
it starts, so the bug is in place in each tensor-parallel worker before the model is built,
as a bug in vLLM would be. Each fault changes one piece of vLLM and nothing around it:

* `unsharded-kv-b`: `ColumnParallelLinear`'s weight loaders (`linear.py`) cut every rank's
  `kv_b_proj` shard at rank 0's offset: each rank holds the leading rows of the whole weight,
  and the shapes still fit (the story's loader bug);
* `router-bias-ignored`: the CPU router's grouped top-k (`fused_moe/router/cpu_router.py`)
  choosing experts without `e_score_correction_bias`;
* `skip-o-proj-all-reduce`: layer 1's `o_proj` (`RowParallelLinear.forward`) leaving out the
  all-reduce of its partial sums;
* `rope-positions-shifted`: the MLA layer (`layers/mla.py`) handing RoPE positions one past
  the token's own at layer 0;
* `w13-halves-swapped`: the routed experts' weight loader (`fused_moe/routed_experts.py`)
  loading each expert's gate projection (`w1`) into the up half of `w13_weight` and the up
  projection (`w3`) into the gate half.
"""

import os

FAULTS = ("unsharded-kv-b", "router-bias-ignored", "skip-o-proj-all-reduce",
          "rope-positions-shifted", "w13-halves-swapped")


def register() -> None:
    fault = os.environ.get("GLMCHECK_VLLM_FAULT")
    if not fault:
        return
    if fault not in FAULTS:
        raise ValueError(f"GLMCHECK_VLLM_FAULT={fault!r}: one of {', '.join(FAULTS)}")
    globals()["_" + fault.replace("-", "_")]()


def _unsharded_kv_b() -> None:
    from vllm.model_executor.layers import linear

    cls = linear.ColumnParallelLinear
    for name in ("weight_loader", "weight_loader_v2"):
        real = getattr(cls, name)

        def loader(self, param, loaded_weight, *args, real=real, **kwargs):
            if not getattr(self, "prefix", "").endswith("kv_b_proj"):
                return real(self, param, loaded_weight, *args, **kwargs)
            # `linear.py` narrows at `self.tp_rank`, `parameter.py` at the parameter's own.
            held = [(o, o.tp_rank) for o in (self, param) if hasattr(o, "tp_rank")]
            for owner, _ in held:
                owner.tp_rank = 0
            try:
                return real(self, param, loaded_weight, *args, **kwargs)
            finally:
                for owner, rank in held:
                    owner.tp_rank = rank

        setattr(cls, name, loader)


def _router_bias_ignored() -> None:
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    real = cpu_router._grouped_topk

    def grouped_topk(*args, **kwargs):
        kwargs["e_score_correction_bias"] = None
        return real(*args, **kwargs)

    cpu_router._grouped_topk = grouped_topk


def _skip_o_proj_all_reduce() -> None:
    from vllm.model_executor.layers import linear

    real_reduce = linear.tensor_model_parallel_all_reduce
    real_forward = linear.RowParallelLinear.forward
    skipping = []
    linear.tensor_model_parallel_all_reduce = lambda x: x if skipping else real_reduce(x)

    def forward(self, *args, **kwargs):
        if getattr(self, "prefix", "") != "model.layers.1.self_attn.o_proj":
            return real_forward(self, *args, **kwargs)
        skipping.append(True)
        try:
            return real_forward(self, *args, **kwargs)
        finally:
            skipping.clear()

    linear.RowParallelLinear.forward = forward


def _rope_positions_shifted() -> None:
    from vllm.model_executor.layers import mla

    real = mla.MultiHeadLatentAttentionWrapper.forward

    def forward(self, positions, *args, **kwargs):
        if self.prefix.startswith("model.layers.0."):
            positions = positions + 1
        return real(self, positions, *args, **kwargs)

    mla.MultiHeadLatentAttentionWrapper.forward = forward


def _w13_halves_swapped() -> None:
    from vllm.model_executor.layers.fused_moe import routed_experts

    cls = routed_experts.RoutedExperts
    real = cls.weight_loader
    swap = {"w1": "w3", "w3": "w1"}

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, *args,
                      **kwargs):
        return real(self, param, loaded_weight, weight_name, swap.get(shard_id, shard_id),
                    expert_id, *args, **kwargs)

    cls.weight_loader = weight_loader
