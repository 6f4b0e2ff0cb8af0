#!/usr/bin/env python3
"""gguf-py's quantization and dequantization, the oracle of glmcheck's quantizers.

    python -m glmcheck_oracle.formats.quantize_ref DIR --row-len N --quantize TYPE,...
                                                   --dequantize TYPE,...

reads DIR/input.f32 (little-endian f32, whole rows of N) and writes, for each --quantize type,
DIR/TYPE.ref: the bytes of `gguf.quants.quantize` of the input rows; and for each --dequantize
type, DIR/TYPE.deq: `gguf.quants.dequantize` (little-endian f32) of DIR/TYPE.ours, blocks that
glmcheck made.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize


def types(arg: str) -> list[Q]:
    return [Q[name] for name in arg.split(",") if name]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--row-len", type=int, required=True)
    parser.add_argument("--quantize", type=types, default=[])
    parser.add_argument("--dequantize", type=types, default=[])
    args = parser.parse_args(argv)
    rows = np.fromfile(args.dir / "input.f32", dtype="<f4").reshape(-1, args.row_len)
    # Overflow to infinity and NaN products are part of what the oracle defines; no warnings.
    with np.errstate(all="ignore"):
        for qtype in args.quantize:
            out = quantize(rows, qtype)
            (args.dir / f"{qtype.name}.ref").write_bytes(np.ascontiguousarray(out).tobytes())
        for qtype in args.dequantize:
            blocks = np.fromfile(args.dir / f"{qtype.name}.ours", dtype=np.uint8).reshape(rows.shape[0], -1)
            out = dequantize(blocks, qtype)
            assert out.dtype == np.float32 and out.shape == rows.shape, qtype.name
            (args.dir / f"{qtype.name}.deq").write_bytes(out.astype("<f4", copy=False).tobytes())


if __name__ == "__main__":
    main(sys.argv[1:])
