#!/usr/bin/env python3
"""Write safetensors checkpoints with torch and what glmcheck must read back from them.

Usage: python -m glmcheck_oracle.formats.make_safetensors OUTDIR

OUTDIR/single/model.safetensors   F32, F16, BF16, I64, F8_E4M3, F8_E8M0 tensors, incl. a scalar and an empty one
OUTDIR/single/expected.json       per tensor: dtype, shape, raw bytes, and torch's f32 bits or int values
OUTDIR/sharded/                   three shards and model.safetensors.index.json, plus expected.json
OUTDIR/fp8/weight.safetensors     [300, 260] F8_E4M3 weights with f32, bf16 and F8_E8M0 *_scale_inv
OUTDIR/fp8/expected.safetensors   torch's f32 block dequantization of each weight
OUTDIR/fp8_table.json             torch's f32 bits of all 256 F8_E4M3, F8_E5M2 and F8_E8M0 bytes
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
}
BLOCK = 128


def f32_bits(t):
    """torch's own float32 conversion, as unsigned 32-bit patterns."""
    return [b & 0xFFFFFFFF for b in t.reshape(-1).to(torch.float32).view(torch.int32).tolist()]


def describe(t):
    """What a reader must find for tensor t."""
    d = {
        "dtype": DTYPE_NAMES[t.dtype],
        "shape": list(t.shape),
        "raw": t.reshape(-1).view(torch.uint8).tolist(),
    }
    if t.dtype == torch.int64:
        d["i64"] = t.reshape(-1).tolist()
    else:
        d["f32_bits"] = f32_bits(t)
    return d


def fp8_bytes(g, shape):
    """Random F8_E4M3 covering every non-NaN byte, subnormals included."""
    b = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def e8m0_bytes(g, shape):
    """Random F8_E8M0 (UE8M0 scales), every exponent but NaN's 0xff possible, both ends included."""
    b = torch.randint(0, 255, shape, generator=g, dtype=torch.int32)
    b.view(-1)[:2] = torch.tensor([0, 254])
    return b.to(torch.uint8).view(torch.float8_e8m0fnu)


def single_tensors(g):
    return {
        "f32.matrix": torch.randn(7, 5, generator=g),
        "f32.scalar": torch.tensor(3.25),
        "f32.empty": torch.zeros(0, 4),
        "f16.cube": (torch.randn(2, 3, 4, generator=g) * 100).to(torch.float16),
        "bf16.vector": (torch.randn(33, generator=g) * 1e-3).to(torch.bfloat16),
        "i64.ids": torch.randint(-(2**62), 2**62, (3, 2), generator=g),
        "fp8.weight": fp8_bytes(g, (4, 9)),
        "e8m0.scale_inv": e8m0_bytes(g, (3, 5)),
    }


def sharded_tensors(g):
    return {
        f"model.layers.{i}.{part}": torch.randn(3, 8 + i, generator=g).to(dtype)
        for i in range(3)
        for part, dtype in (("attn.weight", torch.bfloat16), ("norm.weight", torch.float32))
    }


def write_set(folder, shards):
    """Write shards (a list of name->tensor dicts); with several, an index as transformers does."""
    folder.mkdir(parents=True, exist_ok=True)
    expected, weight_map = {}, {}
    for i, tensors in enumerate(shards):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt", "shard": str(i)})
        for k, t in tensors.items():
            weight_map[k] = name
            expected[k] = describe(t) | {"file": name}
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "expected.json").write_text(json.dumps(expected))


def block_dequant(w, scale):
    """The reference: every element times its tile's scale, one float32 multiply."""
    rows, cols = w.shape
    s = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return w.to(torch.float32) * s


def write_fp8(folder, g):
    folder.mkdir(parents=True, exist_ok=True)
    w = fp8_bytes(g, (300, 260))
    scale = torch.rand(3, 3, generator=g) * 1e-3 + 1e-5
    w2 = fp8_bytes(g, (300, 260))
    scale2 = (torch.rand(3, 3, generator=g) * 4).to(torch.bfloat16)
    # DeepSeek-V3.1's UE8M0 scales in their own dtype, 2^-127 and 2^127 among them.
    w3 = fp8_bytes(g, (300, 260))
    scale3 = e8m0_bytes(g, (3, 3))
    save_file(
        {
            "w.weight": w,
            "w.weight_scale_inv": scale,
            "w2.weight": w2,
            "w2.weight_scale_inv": scale2,
            "w3.weight": w3,
            "w3.weight_scale_inv": scale3,
        },
        folder / "weight.safetensors",
    )
    expected = {
        "w.weight": block_dequant(w, scale),
        "w2.weight": block_dequant(w2, scale2),
        "w3.weight": block_dequant(w3, scale3.float()),
    }
    assert all(e.dtype == torch.float32 for e in expected.values())
    save_file(expected, folder / "expected.safetensors")


def fp8_table():
    every = torch.arange(256, dtype=torch.uint8)
    return {
        "e4m3": f32_bits(every.view(torch.float8_e4m3fn)),
        "e5m2": f32_bits(every.view(torch.float8_e5m2)),
        "e8m0": f32_bits(every.view(torch.float8_e8m0fnu)),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    write_set(args.outdir / "single", [single_tensors(g)])
    sharded = list(sharded_tensors(g).items())
    write_set(args.outdir / "sharded", [dict(sharded[0:3]), dict(sharded[3:4]), dict(sharded[4:])])
    write_fp8(args.outdir / "fp8", g)
    (args.outdir / "fp8_table.json").write_text(json.dumps(fp8_table()))


if __name__ == "__main__":
    main()
