"""The patch a user writes to serve a llama.cpp `glm-dsa` GGUF on vLLM 0.32 through
`vllm-gguf-plugin` 0.0.5 (GGUF's home since it left vLLM's tree).

The plugin's default weights adapter (`vllm_gguf_plugin/weights_adapter/default.py`) maps
deepseek_v2/v3 to GGUF's `deepseek2` and stops at GLM-5 ("Unknown gguf model_type:
glm_moe_dsa"): its names come from gguf-py's tables through a transformers model, and llama.cpp
stores `kv_b_proj` split per head into `attn_k_b` / `attn_v_b`, which no name table rebuilds.
The user's patch is a weights adapter put first in the plugin's registry (`_ADAPTER_REGISTRY`)
for `glm_moe_dsa` configs. It uses the same GGUF reading as the tests' vLLM 0.23 loader patch
(`glmcheck_oracle.vllm23.glm_dsa_load`): glm-dsa names to checkpoint names, `kv_b_proj`
re-assembled from its halves, dequantized, and float weights for the modules vLLM builds without
a quant config or cannot load GGUF bytes into. Everything else is the plugin's and vLLM's: the plugin's `map_weights` unstacks
the experts, its `GGUFConfig` picks each layer's method from `unquantized_modules`, vLLM's
`weight_loader`s cut every rank's shard.
"""

from glmcheck_oracle.vllm23 import glm_dsa_load


# vLLM 0.32's `ReplicatedLinear` has no `weight_loader_v2` and its `weight_loader` no GGUF
# branch (it copies a weight of the parameter's size), so the plugin's `qweight` of a replicated
# layer cannot load: the DSA indexer's `wq_b` goes over dequantized.
REPLICATED = ("self_attn.indexer.wq_b.weight",)


def install(rank_fix: bool) -> None:
    """Register the adapter with the plugin, when the plugin is installed; with `rank_fix`, the
    plugin's fix of its merged-column and QKV loaders (below)."""
    try:
        from vllm_gguf_plugin import weights_adapter
    except ImportError:
        return
    if rank_fix:
        _rank_from_process_group()
    from vllm_gguf_plugin.quantization.utils import DEQUANT_TYPES, UNQUANTIZED_TYPES
    from vllm_gguf_plugin.weights_adapter.base import GGUFLoadSpec
    from vllm_gguf_plugin.weights_adapter.default import GGUFWeightsAdapter

    class GlmDsaAdapter(GGUFWeightsAdapter):
        @classmethod
        def matches(cls, config) -> bool:
            return config.model_type == "glm_moe_dsa"

        def prepare_loading(self, model_path, model_config):
            cfg = model_config.hf_config
            self.weights = glm_dsa_load.GgufWeights(model_path, cfg.num_hidden_layers,
                                                    DEQUANT_TYPES | UNQUANTIZED_TYPES,
                                                    glm_dsa_load.FLOAT_ONLY + REPLICATED)
            self.load_spec = GGUFLoadSpec(
                weights_source=[model_path],
                unquantized_modules=self.weights.unquantized_modules())
            return self.load_spec

        def prepare_weights(self, model_config):
            yield from self.map_weights(self.weights.weights())

    if not any(c.__name__ == GlmDsaAdapter.__name__ for c in weights_adapter._ADAPTER_REGISTRY):
        weights_adapter._ADAPTER_REGISTRY.insert(0, GlmDsaAdapter)


def _rank_from_process_group() -> None:
    """vllm-gguf-plugin 0.0.5's `load_merged_column_weight` and `load_qkv_weight`
    (`quantization/params.py`) narrow at `kwargs.get("tp_rank", 0)`, and vLLM 0.32's
    `weight_loader_v2` never passes `tp_rank`: every rank keeps rank 0's rows of each
    `gate_up_proj` and QKV weight (the plugin's issue 103, fixed after 0.0.5 by reading the
    rank from the process group, as this does)."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm_gguf_plugin.quantization import params

    mixin = params._GGUFParamLoadMixin
    for name in ("load_merged_column_weight", "load_qkv_weight"):
        real = getattr(mixin, name)

        def loader(self, loaded_weight, real=real, **kwargs):
            kwargs.setdefault("tp_rank", get_tensor_model_parallel_rank())
            return real(self, loaded_weight, **kwargs)

        setattr(mixin, name, loader)
