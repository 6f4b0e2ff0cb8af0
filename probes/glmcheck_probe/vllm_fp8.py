"""vLLM's FP8 block-scaled layers (GLM-5-FP8, DeepSeek-V3: FP8 E4M3 weights, one float32
`weight_scale_inv` per 128×128 block) on a CPU without AMX. vLLM's CPU build runs them as W8A16
(activations unquantized) through AMX BRGEMM kernels only, and refuses to build the model
elsewhere ("requires AMX tile support"). The plugin installs, on such CPUs only, the same
arithmetic in torch, with the checkpoint layout kept (no VNNI prepacking):

* `CPUFp8BlockScaledMMKernel` (`vllm/model_executor/kernels/linear/scaled_mm/cpu.py`,
  `fp8_scaled_mm_cpu`): x · (W ⊙ scale)ᵀ, the weight dequantized block by block in float32;
* `CPUExpertsFp8` (`vllm/model_executor/layers/fused_moe/experts/cpu_moe.py`,
  `fused_experts_cpu` with `FP8_W8A16`): each token through its chosen experts' dequantized
  w13 (gate, then up) and w2, SiLU(gate)·up, weighted by the router and summed; and
  `prepare_fp8_moe_layer_for_cpu` keeps the experts unpacked.

Loading, sharding and the block scales' cutting stay vLLM's (`BlockQuantScaleParameter`).
"""

import torch


def install() -> None:
    if torch.cpu._is_amx_tile_supported():
        return  # vLLM's own kernels run
    from vllm.model_executor.kernels.linear.scaled_mm import cpu
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    linear = cpu.CPUFp8BlockScaledMMKernel
    linear.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    linear.process_weights_after_loading = lambda self, layer: None
    linear.apply_weights = _linear_apply
    experts = cpu_moe.CPUExpertsFp8
    experts._supports_current_device = staticmethod(lambda: True)
    experts.apply = _experts_apply
    cpu_moe.prepare_fp8_moe_layer_for_cpu = lambda w13, w2: (w13, w2)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """An FP8 weight [..., n, k] times its block scales [..., ⌈n/bn⌉, ⌈k/bk⌉], in float32."""
    bn, bk = block
    n, k = weight.shape[-2:]
    full = scale.float().repeat_interleave(bn, dim=-2)[..., :n, :]
    full = full.repeat_interleave(bk, dim=-1)[..., :k]
    return weight.float() * full


def _linear_apply(self, layer, x, bias=None, **kwargs):
    params = self._get_layer_params(layer)
    scale = params.weight_scale_inv if params.weight_scale_inv is not None else \
        params.weight_scale
    w = dequantize(params.weight, scale, list(self.weight_group_shape))
    out = x.reshape(-1, x.shape[-1]).float() @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(x.shape[:-1] + (w.shape[0],))


def _experts_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                   global_num_experts, expert_map, a1q_scale, a2_scale, workspace13,
                   workspace2, expert_tokens_meta, apply_router_weight_on_input):
    if apply_router_weight_on_input:
        raise NotImplementedError("CPUExpertsFp8 does not support apply_router_weight_on_input")
    block = list(self.quant_config.block_shape or (128, 128))
    x = hidden_states.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        local = int(expert_map[e]) if expert_map is not None else e
        if local < 0:
            continue
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate_up = x[rows] @ dequantize(w1[local], self.w1_scale[local], block).t()
        gate, up = gate_up.chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ dequantize(w2[local], self.w2_scale[local],
                                                               block).t()
        out.index_add_(0, rows, y * topk_weights[rows, slot].float().unsqueeze(-1))
    output.copy_(out.to(output.dtype))
