#!/usr/bin/env python3
"""Write the blocks benches/dequant.rs measures every dequantizer on, and time gguf-py's on them.

    python benches/gguf_py_dequant.py OUTDIR [--mib 64] [--reps 3] TYPE...

For each TYPE (a gguf-py type name such as Q4_K), writes OUTDIR/TYPE.blocks: random valid blocks
from `glmcheck_oracle.formats.quant_blocks` that dequantize to about MIB MiB of f32. Then times
`gguf.quants.dequantize` on them (numpy, one thread) and prints one JSON object: TYPE -> the best
GB/s of f32 written over REPS runs.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize
from glmcheck_oracle.formats.quant_blocks import random_blocks


def write_blocks(outdir: Path, qtype: Q, mib: int, rng: np.random.Generator) -> np.ndarray:
    """OUTDIR/TYPE.blocks for about `mib` MiB of f32 output; the blocks as flat uint8."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    n_blocks = mib * (1 << 20) // 4 // block_size
    blocks = random_blocks(qtype, n_blocks, rng).reshape(-1)
    (outdir / f"{qtype.name}.blocks").write_bytes(blocks.tobytes())
    return blocks


def best_gbps(blocks: np.ndarray, qtype: Q, reps: int) -> float:
    """The best throughput of `reps` dequantizations, in GB/s of f32 written."""
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        out = dequantize(blocks, qtype)
        best = min(best, time.perf_counter() - start)
    return out.size * 4 / best / 1e9


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("types", nargs="+")
    parser.add_argument("--mib", type=int, default=64, help="MiB of f32 output per type (default 64)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per type (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    result = {}
    for name in args.types:
        qtype = Q[name]
        blocks = write_blocks(args.outdir, qtype, args.mib, rng)
        result[name] = best_gbps(blocks, qtype, args.reps)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
