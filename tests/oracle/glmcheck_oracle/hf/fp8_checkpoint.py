#!/usr/bin/env python3
"""torch's 128×128 block FP8 quantization (DeepSeek-V3 / GLM-5-FP8: scale = block absmax / 448,
element = (weight / scale) rounded to float8_e4m3fn) of an f32 checkpoint, against a checkpoint
said to be that quantization of it.

Usage: python -m glmcheck_oracle.hf.fp8_checkpoint F32_DIR FP8_DIR

Prints JSON: {"fp8": [names stored as FP8], "bf16": [names stored as BF16], "problems": [...]},
a problem being a tensor whose bytes, scales or dtype differ from torch's.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

BLOCK = 128


def tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def quantize(w: torch.Tensor):
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(br * BLOCK, bc * BLOCK)
    padded[:rows, :cols] = w.abs()
    amax = padded.reshape(br, BLOCK, bc, BLOCK).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def main() -> None:
    plain, fp8 = tensors(Path(sys.argv[1])), tensors(Path(sys.argv[2]))
    report = {"fp8": [], "bf16": [], "problems": []}
    for name, stored in sorted(fp8.items()):
        if name.endswith("_scale_inv"):
            continue
        w = plain[name].float()
        if stored.dtype == torch.float8_e4m3fn:
            report["fp8"].append(name)
            q, scale = quantize(w)
            if not torch.equal(stored.view(torch.uint8), q.view(torch.uint8)):
                report["problems"].append(f"{name}: FP8 bytes differ from torch's")
            if not torch.equal(fp8[name + "_scale_inv"], scale):
                report["problems"].append(f"{name}_scale_inv: differs from torch's")
        elif stored.dtype == torch.bfloat16:
            report["bf16"].append(name)
            if not torch.equal(stored, w.to(torch.bfloat16)):
                report["problems"].append(f"{name}: BF16 values differ from torch's rounding")
        else:
            report["problems"].append(f"{name}: dtype {stored.dtype}")
    extra = set(fp8) - set(plain) - {n + "_scale_inv" for n in report["fp8"]}
    report["problems"] += [f"{n}: not in the f32 checkpoint" for n in sorted(extra)]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
