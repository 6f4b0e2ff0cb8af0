"""The four changes that let vLLM 0.23's CPU build construct and load `GlmMoeDsaForCausalLM`.

GLM-5 takes vLLM's MLA path (and, having `index_topk`, its sparse DSA variant), which vLLM only
builds on GPUs. Nothing here touches a loader, a parameter class, a sharding rule or a
collective: each shim replaces one platform decision that a GPU build makes differently, so the
model's modules, parameters and `weight_loader`s are vLLM's own. None of them is needed for a
forward, which this package does not run (the sparse MLA and indexer kernels are GPU-only).

`install()` applies all four, once, before the model is built. Each is needed: without it the
build or load stops with, in order, "MLA is not supported on CPU."; "FlashAttnPrefillBackend
requires flash_attn_varlen_func"; "WorkspaceManager not initialized"; and MLA's
`process_weights_after_loading` finding `kv_b_proj.weight` of shape [0].
"""

import torch

_installed = False


class PrefillStub:
    """Stands in for the MLA prefill backend chosen by
    `vllm/v1/attention/backends/mla/prefill/selector.py` (`get_mla_prefill_backend`), which
    asks for a CUDA device capability. `MLAAttention.__init__` only constructs it; it runs in a
    prefill forward, which a load never reaches."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def __getattr__(self, name):
        raise NotImplementedError(f"MLA prefill `{name}`: no CPU prefill backend (load only)")


def _attention_backend() -> None:
    """`vllm/platforms/cpu.py` `CpuPlatform.get_attn_backend_cls` raises for MLA. Answer as a
    GPU platform would: FlashMLA's sparse backend for DSA models, Triton MLA otherwise. Only
    the backend's class and its impl's constructor run during a load."""
    from vllm.platforms import cpu
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = cpu.CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_mla:
            chosen = (AttentionBackendEnum.FLASHMLA_SPARSE if attn_selector_config.use_sparse
                      else AttentionBackendEnum.TRITON_MLA)
            return chosen.get_path()
        return original(cls, selected_backend, attn_selector_config, num_heads)

    cpu.CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _prefill_backend() -> None:
    from vllm.model_executor.layers.attention import mla_attention

    mla_attention.get_mla_prefill_backend = lambda vllm_config: PrefillStub


def _workspace() -> None:
    """`vllm/v1/worker/gpu_model_runner.py` calls `init_workspace_manager` before building the
    model; the CPU model runner does not, and the sparse MLA impl asks for the workspace."""
    from vllm.v1.worker.workspace import init_workspace_manager

    init_workspace_manager(torch.device("cpu"))


def _keep_float_weights() -> None:
    """`vllm/model_executor/layers/linear.py` (`UnquantizedLinearMethod
    .process_weights_after_loading`) on the CPU prepacks each float weight for oneDNN and
    replaces `weight` by an empty tensor. A GPU build keeps it, and so must this load: MLA
    reads `kv_b_proj.weight` after loading, and the shard manifest lists every weight."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    # linear.py imports it from utils at each call, so utils' name is the one to replace.
    utils.dispatch_cpu_unquantized_gemm = (
        lambda layer, remove_weight: dispatch(layer, remove_weight=False))


def install() -> None:
    global _installed
    if _installed:
        return
    _attention_backend()
    _prefill_backend()
    _workspace()
    _keep_float_weights()
    _installed = True
