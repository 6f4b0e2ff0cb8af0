"""Write a glmcheck shard manifest for a GGUF the way an engine would: gguf-py dequantizes,
numpy slices each weight as vLLM shards it, values are rounded to bf16 (round to nearest, ties to
even, done here on the bits), and the statistics and FNV-1a hash are taken over those bf16 values.
Independent of glmcheck's own plan, slicing, rounding and hashing.

Usage: python -m glmcheck_oracle.formats.shard_manifest MODEL.gguf TP OUT.json
                                                      [--unshard NAME] [--reverse NAME] [--stats-only]
  --unshard NAME  every rank holds the whole tensor NAME (an engine that forgot to shard it)
  --reverse NAME  rank r holds rank TP-1-r's block of NAME
  --stats-only    no hashes: glmcheck identifies the shards from their statistics alone
"""

import argparse
import json

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

# vLLM's split axis of each weight in numpy (row-major) order: q_b, kv_b's k_b and gate are
# ColumnParallel (output rows, whole heads), o_proj RowParallel (input columns), routed
# experts split along their intermediate dimension.
WEIGHTS = {
    "blk.0.attn_q_b.weight": 0,
    "blk.0.attn_k_b.weight": 0,
    "blk.0.attn_output.weight": 1,
    "blk.0.ffn_gate.weight": 0,
    "blk.1.ffn_up_exps.weight": 1,
}

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK = (1 << 64) - 1


def bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def fnv1a(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


def entry(name: str, block: np.ndarray, with_hash: bool) -> dict:
    bits = bf16_bits(block)
    held = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    e = {
        "name": name,
        "shape": list(block.shape),
        "dtype": "bf16",
        "stats": {
            "count": int(held.size),
            "mean": float(held.mean()),
            "std": float(held.std()),
            "min": float(held.min()),
            "max": float(held.max()),
            "absmax": float(np.abs(held).max()),
            "l2": float(np.sqrt((held * held).sum())),
        },
    }
    if with_hash:
        e["hash"] = f"{fnv1a(bits.astype('<u2').tobytes()):016x}"
    return e


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("tp", type=int)
    ap.add_argument("out")
    ap.add_argument("--unshard")
    ap.add_argument("--reverse")
    ap.add_argument("--stats-only", action="store_true")
    a = ap.parse_args()
    reader = GGUFReader(a.model)
    full = {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors if t.name in WEIGHTS}
    assert full.keys() == WEIGHTS.keys(), f"missing {WEIGHTS.keys() - full.keys()}"
    ranks = [{"rank": r, "weights": []} for r in range(a.tp)]
    for name, axis in WEIGHTS.items():
        w = full[name]
        blocks = [w] * a.tp if name == a.unshard else np.split(w, a.tp, axis=axis)
        if name == a.reverse:
            blocks.reverse()
        for r, block in enumerate(blocks):
            ranks[r]["weights"].append(entry(name, block, not a.stats_only))
    manifest = {
        "format": "glmcheck-shards",
        "version": 1,
        "producer": {"name": "glmcheck_oracle.formats.shard_manifest", "gguf": a.model},
        "tp": a.tp,
        "ep": False,
        "ranks": ranks,
    }
    with open(a.out, "w") as f:
        json.dump(manifest, f)


if __name__ == "__main__":
    main()
