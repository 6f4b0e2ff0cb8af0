#!/usr/bin/env python3
"""Random valid GGML blocks and their dequantization by gguf-py, the oracle of glmcheck's dequantizers.

As a module: `random_blocks(qtype, n_blocks, rng)` gives random blocks of any type gguf-py
dequantizes. As a CLI:

    python -m glmcheck_oracle.formats.quant_blocks OUTDIR [--blocks N] [--seed S]

writes, for every such type, OUTDIR/TYPE.blocks (the raw blocks) and OUTDIR/TYPE.expected
(little-endian f32 of `gguf.quants.dequantize`), plus OUTDIR/types.json with every type gguf-py
knows: name, id, block_size, type_size.

Blocks are random bytes with their scale fields overwritten, so that no scale is NaN or infinite
and products stay finite: f16 scales get moderate finite values (some negative, some zero),
MXFP4's E8M0 exponent stays where twelve times its scale is finite. The bit-field codes are left
random: every bit pattern of them is a valid code. F32, F16 and BF16 data stay fully random,
NaNs and infinities included, since dequantizing them must keep every bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize

# Byte offsets of the f16 scales (d, dmin, m) inside each block, from the layouts in gguf-py's
# quants.py.
F16_SCALES: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,),  # d, qs[16]
    Q.Q4_1: (0, 2),  # d, m, qs[16]
    Q.Q5_0: (0,),  # d, qh[4], qs[16]
    Q.Q5_1: (0, 2),  # d, m, qh[4], qs[16]
    Q.Q8_0: (0,),  # d, qs[32]
    Q.Q2_K: (80, 82),  # scales[16], qs[64], d, dmin
    Q.Q3_K: (108,),  # hmask[32], qs[64], scales[12], d
    Q.Q4_K: (0, 2),  # d, dmin, scales[12], qs[128]
    Q.Q5_K: (0, 2),  # d, dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: (208,),  # ql[128], qh[64], scales[16], d
    Q.TQ1_0: (52,),  # qs[48], qh[4], d
    Q.TQ2_0: (64,),  # qs[64], d
    Q.IQ2_XXS: (0,),  # d, qs[64]
    Q.IQ2_XS: (0,),  # d, qs[64], scales[8]
    Q.IQ2_S: (0,),  # d, qs[32], signs[32], qh[8], scales[8]
    Q.IQ3_XXS: (0,),  # d, qs[64], scales[32]
    Q.IQ3_S: (0,),  # d, qs[64], qh[8], signs[32], scales[4]
    Q.IQ1_S: (0,),  # d, qs[32], qh[16]
    Q.IQ4_NL: (0,),  # d, qs[16]
    Q.IQ4_XS: (0,),  # d, scales_h[2], scales_l[4], qs[128]
}

# IQ1_M's d is split over the top nibbles of the four u16 at these offsets (low nibble first).
IQ1_M_D_WORDS = (48, 50, 52, 54)  # after qs[32], qh[16]

# Types whose every bit pattern is data.
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)

# MXFP4's E8M0 byte e scales by 2^(e - 128); up to 250, 12 * 2^(e - 128) stays finite.
E8M0_MAX = 250


def supported_types() -> list[Q]:
    """Every type gguf-py 0.19 dequantizes, in id order."""
    return sorted([*FLOAT_TYPES, *F16_SCALES, Q.IQ1_M, Q.MXFP4, Q.NVFP4], key=lambda t: t.value)


def random_scales(n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` finite f16 of moderate magnitude, about 1 in 16 zero (of either sign), half negative."""
    magnitude = np.exp2(rng.uniform(-14.0, 6.0, n))
    sign = rng.choice(np.array([-1.0, 1.0]), n)
    values = (sign * magnitude).astype(np.float16)
    zero = rng.random(n) < 1 / 16
    values[zero] = np.where(sign[zero] < 0, np.float16(-0.0), np.float16(0.0))
    assert np.isfinite(values).all()
    return values


def random_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """`n_blocks` random valid blocks of `qtype`, as uint8 of shape [n_blocks, type_size]."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    if qtype in FLOAT_TYPES:
        return blocks
    if qtype in F16_SCALES:
        for at in F16_SCALES[qtype]:
            blocks[:, at : at + 2] = random_scales(n_blocks, rng).view(np.uint8).reshape(n_blocks, 2)
    elif qtype == Q.IQ1_M:
        d = random_scales(n_blocks, rng).view(np.uint16)
        for i, at in enumerate(IQ1_M_D_WORDS):
            words = blocks[:, at : at + 2].copy().view(np.uint16)[:, 0]
            words = (words & np.uint16(0x0FFF)) | (((d >> np.uint16(4 * i)) & np.uint16(0xF)) << np.uint16(12))
            blocks[:, at : at + 2] = words.astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
    elif qtype == Q.MXFP4:
        blocks[:, 0] = rng.integers(0, E8M0_MAX + 1, size=n_blocks, dtype=np.uint8)
        blocks[: min(2, n_blocks), 0] = np.arange(min(2, n_blocks))  # the subnormal scales
    elif qtype == Q.NVFP4:
        # Every UE4M3 byte decodes to a finite scale (0x7f, the NaN, to zero); keep them all,
        # but make sure the zero and NaN codes occur.
        blocks[: min(2, n_blocks), 0] = np.array([0x00, 0x7F], dtype=np.uint8)[: min(2, n_blocks)]
    else:
        raise ValueError(f"gguf-py does not dequantize {qtype.name}")
    return blocks


def write_case(outdir: Path, qtype: Q, n_blocks: int, rng: np.random.Generator) -> None:
    """OUTDIR/TYPE.blocks and OUTDIR/TYPE.expected for one type."""
    blocks = random_blocks(qtype, n_blocks, rng)
    expected = dequantize(blocks.reshape(-1), qtype)
    assert expected.dtype == np.float32
    block_size, _ = GGML_QUANT_SIZES[qtype]
    assert expected.size == n_blocks * block_size, qtype.name
    (outdir / f"{qtype.name}.blocks").write_bytes(blocks.tobytes())
    (outdir / f"{qtype.name}.expected").write_bytes(expected.astype("<f4", copy=False).tobytes())


def type_table() -> list[dict]:
    """Every type gguf-py knows, with its sizes and whether it is dequantized here."""
    supported = set(supported_types())
    return [
        {
            "name": t.name,
            "id": int(t.value),
            "block_size": GGML_QUANT_SIZES[t][0],
            "type_size": GGML_QUANT_SIZES[t][1],
            "dequantized": t in supported,
        }
        for t in sorted(GGML_QUANT_SIZES, key=lambda t: t.value)
    ]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--blocks", type=int, default=256, help="blocks per type (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    for qtype in supported_types():
        write_case(args.outdir, qtype, args.blocks, rng)
    (args.outdir / "types.json").write_text(json.dumps(type_table(), indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
