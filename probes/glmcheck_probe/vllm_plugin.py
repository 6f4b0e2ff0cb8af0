"""glmcheck's vLLM plugin (entry point group `vllm.general_plugins`, name `glmcheck`). Two jobs:

* With `GLMCHECK_SHARDS_DIR` set (`vllm_capture` sets it), each worker writes its shard
  manifest to `GLMCHECK_SHARDS_DIR/shards.rank{r}.json` when vLLM's loader has loaded the
  weights and before `process_weights_after_loading` repacks them into kernel layouts (the CPU
  MoE's blocked experts, FlashInfer's swapped w13 halves, oneDNN's prepacked linears): the
  manifest shows the shards as the loader cut them, which is what the sharding plan speaks of.
* On vLLM's CPU build, torch stand-ins for the GPU-only pieces of GLM-5's forward, so that
  vLLM's own model code, loaders, sharding and collectives run a GLM-5 / DeepSeek-V3.2
  checkpoint on a CPU. On any other platform there are none: a GPU user's vLLM runs its own
  kernels. `GLMCHECK_VLLM_STAND_INS=0` turns them off on the CPU too.

Each stand-in replaces one decision or kernel and nothing around it, following the arithmetic of
the vLLM code it replaces:

* `vllm/platforms/cpu.py` `CpuPlatform.get_attn_backend_cls` raises "Sparse Attention is not
  supported on CPU." for DSA models: answered with vLLM's CPU MLA backend (`CPU_MLA`), whose
  metadata and latent KV cache the sparse layers below then use; and the DSA indexer's cache
  (`vllm/v1/attention/backends/mla/indexer.py` `DeepseekV32IndexerBackend`, 64-token blocks
  except on ROCm) takes the CPU MLA backend's 16-token blocks, as it does ROCm's, and its
  metadata builder (Triton kernels) hands on the batch's common metadata (where each sequence
  starts, its length): the stand-in indexer below reads that, never the indexer's cache;
* `SparseAttnIndexer` (`vllm/model_executor/layers/sparse_attn_indexer.py`, DeepGEMM's FP8 MQA
  logits and top-k on CUDA): the DSA scores Σ_h w·relu(q·k) over each sequence's causal keys and
  their top-k, written into vLLM's `topk_indices_buffer`; `per_token_group_quant_fp8` in
  `deepseek_v2.py` leaves the indexer's q unquantized (scale 1), so the FP8 rounding of q and k
  is not reproduced;
* the sparse MLA kernel (FlashMLA's sparse prefill, behind `MLAAttention.forward` in
  `vllm/model_executor/layers/attention/mla_attention.py`) for layers with an indexer: attention
  in the latent space at the indexer's keys, q's nope part absorbed through vLLM's own `W_UK_T`,
  the output through its own `_v_up_proj`, both made by vLLM's `process_weights_after_loading`
  from the rank's `kv_b_proj`; the CPU MLA impl is given the sparse impls'
  `record_logical_topk_ready` (`sparse_mla_attention.py`, a signal between layers that share
  one indexer's top-k) as the no-op it is without such sharing. Prefill of whole prompts only (what a capture runs): a decode
  step, which would read the KV cache, raises.
"""

import os

import torch

from . import dsa_ops

SHARDS_ENV = "GLMCHECK_SHARDS_DIR"
_installed = False


def register() -> None:
    """vLLM calls this in every process it starts (engine, workers, API server)."""
    global _installed
    if _installed:
        return
    _installed = True
    if os.environ.get(SHARDS_ENV):
        _shards_when_loaded(os.environ[SHARDS_ENV])
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("GLMCHECK_VLLM_STAND_INS", "1") != "0":
        _sparse_attention_backend()
        _indexer()
        _sparse_mla()
        from . import vllm_cuda_tree, vllm_fp8

        vllm_fp8.install()
        _gguf_plugin_kernels()
        if vllm_cuda_tree.wanted():
            vllm_cuda_tree.install()


def _shards_when_loaded(out_dir: str) -> None:
    """`base_loader.py`'s `load_model` loads the weights, then calls
    `process_weights_after_loading`: the manifest is written in between."""
    from vllm.model_executor.model_loader import base_loader

    from . import vllm_probe

    process = base_loader.process_weights_after_loading

    def write_then_process(model, model_config, target_device):
        from vllm.distributed import (get_tensor_model_parallel_rank,
                                      get_tensor_model_parallel_world_size)

        rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"shards.rank{rank}.json")
        try:
            vllm_probe.write_shard_manifest(model, path, rank, tp, source=model_config.model,
                                            loaded=True)
        except vllm_probe.UnknownModel as e:
            # vLLM goes on serving; the capture reports why there is no manifest.
            with open(path + ".error", "w") as f:
                f.write(f"{e}\n")
        return process(model, model_config, target_device)

    base_loader.process_weights_after_loading = write_then_process
    try:  # vllm-gguf-plugin's loader calls its own import of the function
        from vllm_gguf_plugin import loader as gguf_loader
    except ImportError:
        return
    gguf_loader.process_weights_after_loading = write_then_process


def _gguf_plugin_kernels() -> None:
    """`vllm-gguf-plugin`'s GGUF kernels (`vllm_gguf_plugin/ops.py`: CUDA, else Triton, neither
    of which runs on a CPU): glmcheck's torch stand-ins (`gguf_kernels`)."""
    try:
        from vllm_gguf_plugin import ops
    except ImportError:
        return
    from .gguf_kernels import Kernels

    Kernels().install(ops)


def _sparse_attention_backend() -> None:
    from vllm.platforms import cpu
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla import indexer

    original = cpu.CpuPlatform.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if attn_selector_config.use_sparse:
            attn_selector_config = _replace(attn_selector_config, use_sparse=False)
        return original(cls, selected_backend, attn_selector_config, num_heads)

    cpu.CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    indexer.DeepseekV32IndexerBackend.get_supported_kernel_block_sizes = staticmethod(
        lambda kv_cache_spec=None: [MultipleOf(16)])
    indexer.DeepseekV32IndexerMetadataBuilder.build = (
        lambda self, common_prefix_len, common_attn_metadata, fast_build=False:
        common_attn_metadata)


def _replace(config, **fields):
    import dataclasses

    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, **fields)
    return config._replace(**fields)


def sequences(t: int) -> list:
    """(start, end) of each sequence among the forward's `t` tokens, from the attention
    metadata of vLLM's forward context; one sequence where there is none (a profiling run)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return [(0, t)]
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):
        meta = meta[0]
    if isinstance(meta, dict):
        meta = next(iter(meta.values()), None)
    starts = getattr(meta, "query_start_loc", None)
    if starts is None:
        return [(0, t)]
    seq_lens = getattr(meta, "seq_lens", None)
    bounds = starts.tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    if seq_lens is not None:
        for (a, b), n in zip(spans, seq_lens.tolist()):
            if n != b - a:
                raise NotImplementedError(
                    "glmcheck's CPU stand-in for sparse MLA runs whole-prompt prefills only "
                    f"(a sequence of {n} tokens has {b - a} in this step)")
    return [(a, b) for a, b in spans if b > a]


def _indexer() -> None:
    from vllm.model_executor.layers import sparse_attn_indexer
    from vllm.model_executor.models import deepseek_v2

    def topk(self, hidden_states, q, k, weights):
        t = hidden_states.shape[0]
        q = q.reshape(t, -1, self.head_dim)
        return dsa_ops.dsa_topk(q, k, weights, self.topk_tokens, sequences(t),
                                self.topk_indices_buffer)

    indexer = sparse_attn_indexer.SparseAttnIndexer
    indexer.forward_native = indexer.forward_cpu = topk
    deepseek_v2.per_token_group_quant_fp8 = (
        lambda x, group, **kw: (x, torch.ones(x.shape[0], 1, dtype=torch.float32)))


def _sparse_mla() -> None:
    from vllm.model_executor.layers.attention import mla_attention

    dense = mla_attention.MLAAttention.forward

    def forward(self, q, kv_c_normed, k_pe, output_shape=None, **kwargs):
        indexer = getattr(self, "indexer", None)
        if indexer is None:
            return dense(self, q, kv_c_normed, k_pe, output_shape, **kwargs)
        t = q.shape[0]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ql_nope = torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)
        latent = dsa_ops.sparse_latent_attention(
            ql_nope, q_pe, kv_c_normed, k_pe.reshape(t, -1), indexer.topk_indices_buffer,
            self.scale, sequences(t))
        out = torch.empty(output_shape, dtype=q.dtype)
        self._v_up_proj(latent.to(q.dtype).contiguous(), out=out)
        return out

    mla_attention.MLAAttention.forward = forward
    from vllm.v1.attention.backends.mla import cpu_mla

    cpu_mla.CPUMLAImpl.record_logical_topk_ready = lambda self: None
