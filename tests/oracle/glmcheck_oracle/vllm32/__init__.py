"""Bugs planted inside vLLM 0.32's own code, for glmcheck's tests: a vLLM general plugin that
does nothing unless `GLMCHECK_VLLM_FAULT` names one of `FAULTS`. vLLM loads it in every process
it starts, so the bug is in place in each tensor-parallel worker before the model is built,
as a bug in vLLM would be. Each fault changes one piece of vLLM and nothing around it:

* `unsharded-kv-b`: `ColumnParallelLinear`'s weight loaders (`linear.py`) cut every rank's
  `kv_b_proj` shard at rank 0's offset: each rank holds the leading rows of the whole weight,
  and the shapes still fit (the story's loader bug);
* `kv-b-scales-unsharded`: in an FP8 checkpoint, the same loaders cut `kv_b_proj`'s weight
  right but its block scales (`weight_scale_inv`, a `BlockQuantScaleParameter`) at rank 0's
  offset on every rank;
* `router-bias-ignored`: the CPU router's grouped top-k (`fused_moe/router/cpu_router.py`)
  choosing experts without `e_score_correction_bias`;
* `group-limit-ignored`: the same grouped top-k choosing among every expert group, not only
  the best `topk_group` (DeepSeek-V2/V3's limit);
* `yarn-mscale-dropped`: DeepSeek's MLA attention (`models/deepseek_v2.py`) leaving YaRN's
  mscale² out of its softmax scale (the rotary embedding's own mscale kept);
* `indexer-rope-style-flipped`: DeepSeek's MLA attention of either tree
  (`models/deepseek_v2.py`'s `DeepseekV2MLAAttention`, `models/deepseek_v32/attention.py`'s
  `DeepseekV32Attention`) building the DSA indexer's rotary embedding in the other pair order
  than `indexer_rope_interleave` says (the config itself untouched): the kind of bug vLLM
  shipped for DeepSeek-V3.2, whose indexer rotated adjacent pairs where the model rotates NeoX
  halves, here on GLM-5, whose indexer rotates adjacent pairs;
* `skip-o-proj-all-reduce`: the all-reduce of layer 1's `o_proj` partial sums left out: in the
  CPU tree by `RowParallelLinear.forward` (`linear.py`), in the CUDA tree, whose o_proj leaves
  its output un-reduced, by `fused_allreduce_rms_norm` before layer 1's post-attention norm
  (`models/common/ops/fused_allreduce_rms_norm.py`);
* `rope-positions-shifted`: the MLA layer handing RoPE positions one past the token's own at
  layer 0 (`layers/mla.py` in the CPU tree, `models/deepseek_v32/attention.py` in the CUDA
  tree);
* `w13-halves-swapped`: the routed experts' weight loader (`fused_moe/routed_experts.py`)
  loading each expert's gate projection (`w1`) into the up half of `w13_weight` and the up
  projection (`w3`) into the gate half;
* `fused-shared-halves-swapped`: with the shared experts fused (`GLMCHECK_VLLM_FUSE_SHARED_EXPERTS`),
  the same swap for the fused shared expert's slot only;
* `requests-share-attention`: the sparse attention and the DSA indexer handed the whole batch as
  one sequence (the per-request starts, `query_start_loc`, dropped), so that a request's
  tokens attend to the requests batched before it: alone a request is unchanged, beside
  others it is not. It changes glmcheck's own CPU stand-in for those kernels
  (`glmcheck_probe.vllm_plugin.sequences`), the piece that reads the batch's sequence bounds.
"""

import os

# Not a fault: vLLM's fused shared experts (the shared expert stored as an extra expert after
# the routed ones, ROCm AITER's layout), turned on for a load on the CPU, where vLLM offers them
# nowhere: `rocm_aiter_ops.is_fusion_moe_shared_experts_enabled` answers yes, and the AITER
# routing table the experts' map fills on the GPU (`expert_map_manager.py`) is not made. A load
# only: the CPU's routers never pick the fused slot.
FUSE_SHARED_ENV = "GLMCHECK_VLLM_FUSE_SHARED_EXPERTS"

# Not a fault either: with a GGUF, the user's glm-dsa patch for vllm-gguf-plugin
# (`glm_dsa_gguf.py`) is always in place; this adds the plugin's own fix of its merged-column
# and QKV loaders, which 0.0.5 lacks.
GGUF_RANK_FIX_ENV = "GLMCHECK_VLLM_GGUF_RANK_FIX"

FAULTS = ("unsharded-kv-b", "kv-b-scales-unsharded", "router-bias-ignored", "group-limit-ignored",
          "yarn-mscale-dropped", "indexer-rope-style-flipped", "skip-o-proj-all-reduce", "rope-positions-shifted",
          "w13-halves-swapped", "fused-shared-halves-swapped", "requests-share-attention")


def register() -> None:
    from . import glm_dsa_gguf

    glm_dsa_gguf.install(rank_fix=os.environ.get(GGUF_RANK_FIX_ENV) == "1")
    if os.environ.get(FUSE_SHARED_ENV) == "1":
        from vllm._aiter_ops import rocm_aiter_ops

        from vllm.model_executor.layers.fused_moe import expert_map_manager

        rocm_aiter_ops.is_fusion_moe_shared_experts_enabled = classmethod(lambda cls: True)
        manager = expert_map_manager.ExpertMapManager
        manager._init_aiter_shared_experts_topK_buffer = lambda self: None
    fault = os.environ.get("GLMCHECK_VLLM_FAULT")
    if not fault:
        return
    if fault not in FAULTS:
        raise ValueError(f"GLMCHECK_VLLM_FAULT={fault!r}: one of {', '.join(FAULTS)}")
    globals()["_" + fault.replace("-", "_")]()


def _unsharded_kv_b(scales_only: bool = False) -> None:
    from vllm.model_executor.layers import linear
    from vllm.model_executor.parameter import BlockQuantScaleParameter

    cls = linear.ColumnParallelLinear
    for name in ("weight_loader", "weight_loader_v2"):
        real = getattr(cls, name)

        def loader(self, param, loaded_weight, *args, real=real, **kwargs):
            if not getattr(self, "prefix", "").endswith("kv_b_proj") or (
                    scales_only and not isinstance(param, BlockQuantScaleParameter)):
                return real(self, param, loaded_weight, *args, **kwargs)
            # `linear.py` narrows at `self.tp_rank`, `parameter.py` at the parameter's own.
            owners = (param,) if scales_only else (self, param)
            held = [(o, o.tp_rank) for o in owners if hasattr(o, "tp_rank")]
            for owner, _ in held:
                owner.tp_rank = 0
            try:
                return real(self, param, loaded_weight, *args, **kwargs)
            finally:
                for owner, rank in held:
                    owner.tp_rank = rank

        setattr(cls, name, loader)


def _kv_b_scales_unsharded() -> None:
    _unsharded_kv_b(scales_only=True)


def _router_bias_ignored() -> None:
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    real = cpu_router._grouped_topk

    def grouped_topk(*args, **kwargs):
        kwargs["e_score_correction_bias"] = None
        return real(*args, **kwargs)

    cpu_router._grouped_topk = grouped_topk


def _group_limit_ignored() -> None:
    import inspect

    from vllm.model_executor.layers.fused_moe.router import cpu_router

    real = cpu_router._grouped_topk
    signature = inspect.signature(real)

    def grouped_topk(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.arguments["topk_group"] = call.arguments["num_expert_group"]
        return real(*call.args, **call.kwargs)

    cpu_router._grouped_topk = grouped_topk


def _yarn_mscale_dropped() -> None:
    from vllm.model_executor.models import deepseek_v2

    # The module's own helper serves only the attention's softmax scale; the rotary
    # embedding's mscale comes from `rotary_embedding/deepseek_scaling_rope.py`'s.
    deepseek_v2.yarn_get_mscale = lambda *_args, **_kwargs: 1.0


def _indexer_rope_style_flipped() -> None:
    import inspect

    from vllm.model_executor.models import deepseek_v2
    from vllm.models.deepseek_v32 import attention

    for cls in (deepseek_v2.DeepseekV2MLAAttention, attention.DeepseekV32Attention):
        real = cls.__init__
        signature = inspect.signature(real)

        def init(self, *args, real=real, signature=signature, **kwargs):
            config = signature.bind(self, *args, **kwargs).arguments["config"]
            said = getattr(config, "indexer_rope_interleave", False)
            config.indexer_rope_interleave = not said
            try:
                real(self, *args, **kwargs)
            finally:
                config.indexer_rope_interleave = said

        cls.__init__ = init


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

    from vllm.models.common.ops import fused_allreduce_rms_norm as fused
    from vllm.models.deepseek_v32.nvidia import model

    real_fused, real_layer = fused.tensor_model_parallel_all_reduce, model.DeepseekV32DecoderLayer
    layer_forward, target = real_layer.forward, []
    fused.tensor_model_parallel_all_reduce = lambda x: x if skipping else real_fused(x)
    real_norm = model.fused_allreduce_rms_norm

    def allreduce_rms_norm(hidden_states, residual, norm):
        if target and norm is target[0]:
            skipping.append(True)
        try:
            return real_norm(hidden_states, residual, norm)
        finally:
            skipping.clear()

    def decoder_forward(self, *args, **kwargs):
        if self.layer_idx == 1:
            target.append(self.post_attention_layernorm)
        try:
            return layer_forward(self, *args, **kwargs)
        finally:
            target.clear()

    model.fused_allreduce_rms_norm = allreduce_rms_norm
    real_layer.forward = decoder_forward


def _rope_positions_shifted() -> None:
    from vllm.model_executor.layers import mla
    from vllm.models.deepseek_v32 import attention

    for cls in (mla.MultiHeadLatentAttentionWrapper, attention.DeepseekV32Attention):
        real = cls.forward

        def forward(self, positions, *args, real=real, **kwargs):
            # The CPU tree's wrapper knows its `prefix`, the CUDA tree's attention its
            # `layer_name` (`model.layers.0.self_attn.attn`).
            if (getattr(self, "prefix", None) or self.layer_name).startswith("model.layers.0."):
                positions = positions + 1
            return real(self, positions, *args, **kwargs)

        cls.forward = forward


def _w13_halves_swapped(fused_shared_only: bool = False) -> None:
    from vllm.model_executor.layers.fused_moe import routed_experts

    cls = routed_experts.RoutedExperts
    real = cls.weight_loader
    swap = {"w1": "w3", "w3": "w1"}

    def weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id, *args,
                      **kwargs):
        # The fused shared experts come after the routed ones.
        if not fused_shared_only or expert_id >= self.global_num_experts:
            shard_id = swap.get(shard_id, shard_id)
        return real(self, param, loaded_weight, weight_name, shard_id, expert_id, *args,
                    **kwargs)

    cls.weight_loader = weight_loader


def _fused_shared_halves_swapped() -> None:
    _w13_halves_swapped(fused_shared_only=True)


def _requests_share_attention() -> None:
    from glmcheck_probe import vllm_plugin

    vllm_plugin.sequences = lambda t: [(0, t)]
