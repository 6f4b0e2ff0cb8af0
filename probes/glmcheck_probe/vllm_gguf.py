"""Shard-manifest entries for vLLM's GGUF parameters (`GGUFConfig`): the bytes a rank holds of
a quantized GGUF tensor, with the GGML type, the byte shape, where vLLM's sharding took them
from in the file tensor, and their FNV-1a 64 hash (manifest version 2, probes/docs/vllm.md).

vLLM 0.23, and `vllm-gguf-plugin` on later vLLMs, keep GGUF weights as the file's raw
blocks: a `qweight` of uint8 rows beside a `qweight_type`. A ColumnParallel layer holds a run of
the tensor's rows, a RowParallel one a run of each row's bytes; a merged layer (`gate_up_proj`,
`fused_qkv_a_proj`) holds its parts' rows in a container until `process_weights_after_loading`
concatenates them, padded to the widest part, recording each part's place in
`shard_offset_map` (its type in `qweight_type.shard_weight_type`); the stacked experts are
`w13_qweight` [E, 2·I/tp, bytes] (gate rows, then up rows) and `w2_qweight` [E, H, bytes/tp].
Each part becomes one entry under its checkpoint name, so glmcheck can find its bytes in the
file. Hashing the bytes, not dequantized values, makes the check exact whatever the type.
"""

import torch

from .trace import fnv1a

# Checkpoint names of a merged layer's parts, by shard id, after the layer's module path.
MERGED_PARTS = {
    "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
QKV_PARTS = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}


def is_gguf(param) -> bool:
    """A GGUF `qweight`: vLLM 0.23's (`is_gguf_weight`), or `vllm-gguf-plugin`'s, which marks
    none but keeps the parts of a merged layer in `data_container` until
    `process_weights_after_loading` pads them into one tensor (the parameter stays
    uninitialized until then)."""
    if getattr(param, "is_gguf_weight", False):
        return param.dtype.itemsize == 1
    return hasattr(param, "data_container") and hasattr(param, "tensor_shape")


def _parts(param) -> list:
    """(shard id, bytes) of each part of a merged layer's `qweight`, in the parameter's
    order: from the padded tensor's `shard_offset_map` after processing, else from the
    `data_container` the loader filled; empty for a layer of one part."""
    offsets = getattr(param, "shard_offset_map", None)
    if offsets:
        return [(sid, param.data[start:end, :width])
                for sid, (start, end, width) in offsets.items()]
    held = getattr(param, "data_container", None) or []
    ids = getattr(param, "shard_id_map", {})
    return [(sid, held[i]) for sid, i in ids.items()] if len(held) > 1 else []


def _type_name(code: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(int(code)).name


def _entry(name, data, type_code, rows, byte_cols, hash_limit, dequant=None):
    """One quantized entry. `rows` / `byte_cols`: [start, end) in the file tensor along its
    row axis (per expert for 3-D tensors) and its row bytes, as vLLM's sharding places them.
    `dequant`: the dtype in which to record the engine's own dequantization of the bytes."""
    t = data.detach().cpu().contiguous()
    entry = {"name": name, "ggml_type": _type_name(type_code),
             "shape": [int(d) for d in t.shape],  # the bytes as held
             "source": {"rows": [int(rows[0]), int(rows[1])],
                        "byte_cols": [int(byte_cols[0]), int(byte_cols[1])]}}
    if t.numel() <= hash_limit:
        entry["hash"] = f"{fnv1a(t.numpy().tobytes()):016x}"
    if dequant is not None:
        entry["dequant"] = engine_dequant(t, int(type_code), dequant)
    return entry


DEQUANT_OP = "ggml_dequantize"
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def engine_dequant(t, type_code: int, dtype) -> dict:
    """vLLM's own `ggml_dequantize` of the bytes `t` ([rows, bytes] or [experts, rows, bytes])
    in `dtype`: the output's FNV-1a hash and per-block sums, or why it did not run. vLLM's CPU
    build has no GGUF kernels: there the op is absent and the entry says so."""
    import gguf
    from vllm import _custom_ops as ops

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_code)]
    row_bytes = int(t.shape[-1])
    if row_bytes % size:
        return {"op": DEQUANT_OP, "absent": f"rows of {row_bytes} bytes are not whole blocks "
                                            f"of {size} bytes: not dequantized"}
    rows, cols = t.numel() // row_bytes, row_bytes // size * block
    try:
        out = ops.ggml_dequantize(t.reshape(rows, row_bytes), type_code, rows, cols, dtype)
    except (AttributeError, NotImplementedError, RuntimeError) as e:
        return {"op": DEQUANT_OP, "absent": f"vllm._custom_ops.{DEQUANT_OP} did not run "
                                            f"({type(e).__name__}: {str(e)[:160]})"}
    out = out.detach().cpu().to(dtype).contiguous()
    raw = out.view(torch.int32 if out.element_size() == 4 else torch.int16)
    return {"op": DEQUANT_OP, "dtype": DTYPE_NAMES[dtype],
            "hash": f"{fnv1a(raw.numpy().astype(raw.numpy().dtype.newbyteorder('<')).tobytes()):016x}",
            "block_sums": out.to(torch.float64).reshape(-1, block).sum(dim=1).tolist()}


def _rank(module, cls: str) -> int:
    """The rank whose slice the layer holds; a ReplicatedLinear keeps vLLM's tp_rank though it
    holds the whole tensor."""
    if cls in ("ReplicatedLinear", "GateLinear") or int(getattr(module, "tp_size", 1)) == 1:
        return 0
    return int(getattr(module, "tp_rank", 0))


def linear_entries(name: str, module, param, cls: str, hash_limit: int, dequant=None) -> list:
    """Entries of a linear layer's `qweight` (`name` ends in `.weight`)."""
    rank = _rank(module, cls)
    types = module.qweight_type
    parts_held = _parts(param)
    if not parts_held:
        rows, width = int(param.shape[0]), int(param.shape[1])
        if cls == "RowParallelLinear":
            rows_at, cols_at = (0, rows), (rank * width, (rank + 1) * width)
        else:  # Column (this rank's rows) or replicated (tp_size 1: every row)
            rows_at, cols_at = (rank * rows, (rank + 1) * rows), (0, width)
        return [_entry(name, param.data, types.weight_type, rows_at, cols_at, hash_limit, dequant)]
    stem, leaf = name.rsplit(".", 1)[0].rsplit(".", 1)
    parts = MERGED_PARTS.get(leaf)
    out = []
    for shard_id, held in sorted(parts_held, key=lambda kv: str(kv[0])):
        if isinstance(shard_id, str):
            part = QKV_PARTS[shard_id]
        elif parts is not None and shard_id < len(parts):
            part = parts[shard_id]
        else:
            raise ValueError(f"{name}: shard {shard_id!r} of a merged layer the probe does "
                             "not know")
        n, width = int(held.shape[0]), int(held.shape[1])
        out.append(_entry(f"{stem}.{part}.weight", held, types.shard_weight_type[shard_id],
                          (rank * n, (rank + 1) * n), (0, width), hash_limit, dequant))
    return out


def embedding_entries(name: str, module, param, hash_limit: int, dequant=None) -> list:
    """A vocab-parallel table's `qweight`: this rank's vocabulary rows, padding left out."""
    ix = module.shard_indices
    n = ix.org_vocab_end_index - ix.org_vocab_start_index
    return [_entry(name, param.data[:n], module.qweight_type.weight_type,
                   (ix.org_vocab_start_index, ix.org_vocab_end_index),
                   (0, int(param.shape[1])), hash_limit, dequant)]


def expert_entries(prefix: str, module, which: str, param, hash_limit: int,
                   dequant=None) -> list:
    """FusedMoE's `w13_qweight` (gate and up halves) or `w2_qweight` under the stacked
    checkpoint names `PREFIX.experts.{gate,up,down}_proj`."""
    rank = int(getattr(module, "tp_rank", 0))
    kind = getattr(module, f"{which}_qweight_type").weight_type
    width = int(param.shape[-1])
    if which == "w2":
        return [_entry(f"{prefix}.down_proj", param.data, kind, (0, int(param.shape[1])),
                       (rank * width, (rank + 1) * width), hash_limit, dequant)]
    half = int(param.shape[1]) // 2
    return [_entry(f"{prefix}.{part}", param.data[:, i * half:(i + 1) * half], kind,
                   (rank * half, (rank + 1) * half), (0, width), hash_limit, dequant)
            for i, part in enumerate(("gate_proj", "up_proj"))]
