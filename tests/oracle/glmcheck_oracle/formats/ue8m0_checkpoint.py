#!/usr/bin/env python3
"""DeepSeek-V3.1's FP8 layout checked with torch: a checkpoint said to be the UE8M0 block
quantization of an f32 one. Each 128×128 block's scale is its absmax / 448 rounded up to a power
of two (DeepGEMM's `ceil_to_ue8m0`, computed exactly with frexp); each element is the weight
divided by that scale, rounded to float8_e4m3fn.

Usage: python -m glmcheck_oracle.formats.ue8m0_checkpoint F32_DIR FP8_DIR

Prints JSON: {"fp8": [names stored as FP8], "scales": how many scales, "problems": [...]}, a
problem being a scale that is no power of two, or FP8 bytes or scales that differ from torch's.
"""

import json
import sys
from pathlib import Path

import torch

from glmcheck_oracle.hf.fp8_checkpoint import BLOCK, quantize, tensors


def powers_of_two(s):
    """Where s is a positive finite power of two: frexp gives s = m·2^e with m = 0.5 exactly."""
    mantissa, _ = torch.frexp(s)
    return torch.isfinite(s) & (mantissa == 0.5)


def ceil_pow2(s):
    """The smallest power of two at or above each positive s."""
    _, exponent = torch.frexp(s)
    return torch.where(powers_of_two(s), s, torch.ldexp(torch.ones_like(s), exponent))


def main() -> None:
    plain, fp8 = tensors(Path(sys.argv[1])), tensors(Path(sys.argv[2]))
    report = {"fp8": [], "scales": 0, "problems": []}
    for name, stored in sorted(fp8.items()):
        if stored.dtype != torch.float8_e4m3fn:
            continue
        report["fp8"].append(name)
        stored_scale = fp8[name + "_scale_inv"]
        report["scales"] += stored_scale.numel()
        if not bool(powers_of_two(stored_scale).all()):
            report["problems"].append(f"{name}_scale_inv: a scale is no power of two")
        w = plain[name].float()
        _, scale = quantize(w)
        scale = ceil_pow2(scale)
        rows, cols = w.shape
        full = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
        q = (w / full).to(torch.float8_e4m3fn)
        if not torch.equal(stored.view(torch.uint8), q.view(torch.uint8)):
            report["problems"].append(f"{name}: FP8 bytes differ from torch's")
        if not torch.equal(stored_scale, scale):
            report["problems"].append(f"{name}_scale_inv: differs from torch's")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
