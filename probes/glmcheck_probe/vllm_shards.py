"""The vLLM worker's shard manifest: every parameter's local shape, dtype, hash and statistics
(a GGUF model's quantized parameters as their raw bytes, manifest version 2, through
`vllm_gguf`; an FP8 weight dequantized through `vllm_fp8`), in the format
`glmcheck shards --actual` reads, and the merge of the ranks' files into one.
"""

import json
import os

import torch

from . import vllm_fp8, vllm_gguf
from .trace import fnv1a, moments
from .vllm_model import (DTYPES, EMBED, FP8, FUSED_MOE, GGUF_TYPE, GGUF_WEIGHT, LM_HEAD,
                         ROUTED_EXPERTS, UnknownModel, _class, _config, _model_dtype, _param_rule,
                         _require, _vllm_version)

SHARDS_FORMAT = "glmcheck-shards"
# Version 1 lists float values only; version 2 adds entries of quantized GGUF bytes
# (`ggml_type`, `byte_shape`, `source`), written only when the model holds some.
SHARDS_VERSION = 1
SHARDS_VERSION_QUANT = 2
# Tensors above this many bytes get statistics but no hash by default (the hash is a Python
# loop, about 0.15 s per MB); glmcheck then identifies the shard from its statistics.
HASH_LIMIT = 64 << 20


def check_parameters(model) -> list:
    """Every parameter of `model` against the names the probe knows: (name, tensor) of the
    weights to list, and (name, reason) of those skipped. Raises `UnknownModel` for any other
    parameter, or a known name held by a module of an unknown class."""
    cfg = _config(model)
    modules = dict(model.named_modules())
    listed, skipped = [], []
    for name, param in model.named_parameters():
        if GGUF_TYPE.search(name):
            continue  # read with its qweight
        classes, _stem, skip = _param_rule(name, cfg.num_hidden_layers)
        owner_path = name.rsplit(".", 1)[0]
        if classes is None and skip is None:
            raise UnknownModel(f"{name}: a parameter this probe does not know (module "
                               f"{owner_path}, class {_class(modules.get(owner_path))})")
        if classes is not None:
            _require(owner_path, modules.get(owner_path), classes)
        if skip is not None:
            skipped.append((name, skip))
        elif vllm_gguf.is_gguf(param):
            listed.append((name, param))
        elif param.dtype in FP8:
            leaf = name.rsplit(".", 1)[1]
            if getattr(modules.get(owner_path), leaf + "_scale_inv", None) is None:
                skipped.append((name, f"dtype {param.dtype} without block scales"))
            else:
                listed.append((name, param))
        elif param.dtype not in DTYPES:
            skipped.append((name, f"dtype {param.dtype}"))
        else:
            listed.append((name, param))
    if not listed:
        raise UnknownModel("model: no parameter the probe knows")
    return listed, skipped


def shard_entry(name: str, tensor: torch.Tensor, hash_limit: int = HASH_LIMIT) -> dict:
    """One manifest entry: shape, dtype, statistics of the values as held, and the FNV-1a 64
    of their little-endian bytes in that dtype (left out above `hash_limit` bytes)."""
    t = tensor.detach().cpu().contiguous()
    held = t.to(torch.float32).numpy()
    s = moments(held)
    entry = {"name": name, "shape": list(t.shape), "dtype": DTYPES[t.dtype],
             "stats": {k: s[k] for k in ("count", "mean", "std", "min", "max", "absmax", "l2")}}
    size = t.numel() * t.element_size()
    if size <= hash_limit:
        raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
        entry["hash"] = f"{fnv1a(raw.numpy().astype(raw.numpy().dtype.newbyteorder('<')).tobytes()):016x}"
    return entry


def write_shard_manifest(model, path: str, rank: int, world_size: int, ep: bool = False,
                         hash_limit: int = HASH_LIMIT, source: str = None,
                         check_dequant: bool = False, loaded: bool = False) -> dict:
    """Write this worker's shard manifest (one rank) to `path`; the manifest. Merge the ranks'
    files with `merge_shard_manifests`. `source`: the model path, recorded in the producer.
    `check_dequant`: also run the engine's GGUF dequantization on every quantized shard, in the
    model's dtype, and record its output's hash and block sums (or that the op is absent).
    `loaded`: written between vLLM's loading and its `process_weights_after_loading` (the
    producer says so), so that kernel repacking does not hide the layout the loader made.
    An FP8 weight with block scales is listed dequantized (its values times its scales, in
    float32, as glmcheck reads the checkpoint), and its `weight_scale_inv` as an entry of its
    own."""
    listed, skipped = check_parameters(model)
    modules = dict(model.named_modules())
    dequant = _model_dtype(model) if check_dequant else None
    block = _fp8_block(_config(model))
    weights = []
    for name, param in listed:
        path_, leaf = name.rsplit(".", 1)
        if param.dtype in FP8:
            param = vllm_fp8.dequantize(param, getattr(modules[path_], leaf + "_scale_inv"), block)
        weights += _entries(name, modules[path_], leaf, param, hash_limit, dequant)
    quantized = any("ggml_type" in w for w in weights)
    manifest = {
        "format": SHARDS_FORMAT,
        "version": SHARDS_VERSION_QUANT if quantized else SHARDS_VERSION,
        "producer": {"name": "glmcheck_probe", "engine": "vllm", "vllm": _vllm_version(),
                     "torch": torch.__version__, "model": source,
                     "when": "as loaded" if loaded else "after loading",
                     "skipped": [{"name": n, "why": w} for n, w in skipped]},
        "tp": int(world_size), "ep": bool(ep),
        "ranks": [{"rank": int(rank), "weights": weights}],
    }
    _write_json(path, manifest)
    return manifest


def _fp8_block(cfg) -> list:
    """The checkpoint's FP8 block (`quantization_config.weight_block_size`; 128×128 as
    GLM-5-FP8 and DeepSeek-V3 ship)."""
    quant = getattr(cfg, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = vars(quant)
    return list(quant.get("weight_block_size") or (128, 128))


def _entries(name: str, module, leaf: str, param, hash_limit: int, dequant=None) -> list:
    """The manifest entries of one parameter (`name` as vLLM names it): one float entry, or
    one entry per part of a GGUF `qweight`."""
    # vLLM 0.32's `experts.routed_experts.w13_weight` is 0.23's `experts.w13_weight`.
    weight = GGUF_WEIGHT.sub(r"\1weight", name).replace(".experts.routed_experts.", ".experts.")
    cls = _class(module)
    vocab = cls in EMBED | LM_HEAD
    if not vllm_gguf.is_gguf(param):
        held = param
        ix = getattr(module, "shard_indices", None) if vocab else None
        if ix is not None:  # vocab rows past this rank's share are padding (zeros)
            held = param[: ix.org_vocab_end_index - ix.org_vocab_start_index]
        return [shard_entry(weight, held, hash_limit)]
    if vocab:
        return vllm_gguf.embedding_entries(weight, module, param, hash_limit, dequant)
    if cls in FUSED_MOE | ROUTED_EXPERTS:
        prefix = weight.rsplit(".", 1)[0]
        return vllm_gguf.expert_entries(prefix, module, leaf.split("_")[0], param, hash_limit,
                                        dequant)
    return vllm_gguf.linear_entries(weight, module, param, cls, hash_limit, dequant)


def merge_shard_manifests(out: str, paths: list) -> dict:
    """One manifest from the per-rank files of one run (same tp and ep)."""
    parts = [json.load(open(p)) for p in paths]
    if not parts:
        raise ValueError("merge-shards: no rank manifests given")
    first = parts[0]
    for p, m in zip(paths, parts):
        if m.get("format") != SHARDS_FORMAT:
            raise ValueError(f"{p}: format {m.get('format')!r} is not {SHARDS_FORMAT!r}")
        if (m["tp"], m["ep"]) != (first["tp"], first["ep"]):
            raise ValueError(f"{p}: tp {m['tp']}, ep {m['ep']} differ from {paths[0]}'s")
    ranks = sorted((r for m in parts for r in m["ranks"]), key=lambda r: r["rank"])
    seen = [r["rank"] for r in ranks]
    if len(set(seen)) != len(seen):
        raise ValueError(f"merge-shards: a rank is listed twice ({seen})")
    merged = {**first, "ranks": ranks}
    _write_json(out, merged)
    return merged


def _write_json(path: str, value: dict) -> None:
    tmp = path + ".partial"
    with open(tmp, "w") as f:
        json.dump(value, f)
        f.write("\n")
    os.replace(tmp, path)
