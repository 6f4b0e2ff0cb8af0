"""Torch stand-ins for the GGUF kernels vLLM calls on a GPU, so that vLLM's own GGUF layers run
on a CPU: `ggml_dequantize`, `ggml_mul_mat_vec_a8`, `ggml_mul_mat_a8`, `ggml_moe_a8_vec`,
`ggml_moe_a8` and `moe_sum`, with the signatures of vLLM 0.23's `vllm/_custom_ops.py` and of
`vllm-gguf-plugin`'s `vllm_gguf_plugin/ops.py`, which took them over when GGUF left vLLM's tree.

The bytes are dequantized by gguf-py (bit-exact with ggml) and multiplied in the activation's
dtype. The CUDA kernels quantize the activation to Q8_1 first; that rounding is not
reproduced. As the CUDA kernels do, a row is read as `columns // block_size` whole blocks, so
a shard cut inside a block yields what its whole blocks hold (nothing, for a cut inside the
first block). MoE runs the vector kernel's path only (at most 64 tokens, what a capture runs).
"""

import gguf
import numpy as np
import torch


class Kernels:
    """The stand-ins, sharing one dequantization (`values`, which a test may replace)."""

    @staticmethod
    def values(raw: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        """Whole blocks of one GGML type (uint8 rows) to float values."""
        return gguf.quants.dequantize(raw, qtype)

    def dequantize(self, w: torch.Tensor, quant_type: int, columns: int) -> torch.Tensor:
        """Rows of GGML blocks to [rows, columns] float32: each row read as
        `columns // block_size` whole blocks, zeros past them."""
        qtype = gguf.GGMLQuantizationType(int(quant_type))
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows = w.shape[0]
        raw = w.reshape(rows, -1).contiguous().numpy().view(np.uint8)
        whole = min(columns // block, raw.shape[1] // size)
        out = torch.zeros(rows, columns, dtype=torch.float32)
        if whole == 0:
            return out
        used = np.ascontiguousarray(raw[:, : whole * size])
        values = self.values(used, qtype)
        out[:, : whole * block] = torch.from_numpy(np.asarray(values, np.float32)).reshape(rows, -1)
        return out

    def ggml_dequantize(self, w, quant_type, m, n, dtype=None):
        """As the CUDA op: the bytes as one stream of blocks, m·n values shaped [m, n]."""
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(quant_type))][0]
        flat = self.dequantize(w.reshape(1, -1), quant_type, m * n // block * block)
        return flat.reshape(m, n).to(dtype or torch.float16)

    def ggml_mul_mat(self, w, x, quant_type, row):
        weight = self.dequantize(w, quant_type, x.shape[-1]).to(x.dtype)
        return x @ weight.T

    def ggml_moe_a8_vec(self, x, w, topk_ids, top_k, quant_type, row, tokens):
        """Row i·top_k + j: expert `topk_ids.flatten()[i·top_k + j]` applied to x[i]."""
        experts = topk_ids.reshape(-1).tolist()
        out = torch.empty(tokens * top_k, row, dtype=x.dtype)
        cache = {}
        for r, e in enumerate(experts[: tokens * top_k]):
            if e not in cache:
                cache[e] = self.dequantize(w[e], quant_type, x.shape[-1]).to(x.dtype)
            out[r] = cache[e] @ x[r // top_k]
        return out

    @staticmethod
    def ggml_moe_a8(*args, **kwargs):
        raise NotImplementedError("the stand-in runs GGUF MoE on at most 64 tokens (the "
                                  "vector kernel's path); use a shorter prompt")

    @staticmethod
    def moe_sum(inp, out):
        out.copy_(inp.sum(dim=1))

    def install(self, ops) -> None:
        """Put the stand-ins in place of the kernels of `ops` (vLLM 0.23's `_custom_ops`, or
        the plugin's `ops`), whose callers look them up there at each call."""
        ops.ggml_dequantize = self.ggml_dequantize
        ops.ggml_mul_mat_vec_a8 = self.ggml_mul_mat
        ops.ggml_mul_mat_a8 = self.ggml_mul_mat
        ops.ggml_moe_a8_vec = self.ggml_moe_a8_vec
        ops.ggml_moe_a8 = self.ggml_moe_a8
        ops.moe_sum = self.moe_sum
