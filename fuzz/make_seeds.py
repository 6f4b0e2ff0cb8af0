#!/usr/bin/env python3
"""Write small valid seed files for the fuzz targets.

    python fuzz/make_seeds.py [CORPUS]      (default: fuzz/corpus)

CORPUS/gguf_header/*.gguf comes from gguf-py's GGUFWriter: metadata of every value type, nested
arrays, a custom alignment, and tensors of float, legacy, k- and i-quant types made of random
valid blocks (`glmcheck_oracle.formats.quant_blocks`, installed in .venv by scripts/setup-venv).
CORPUS/safetensors_header/*.safetensors comes from safetensors' torch writer: F32, BF16, I64, and
an FP8 weight with its block scale.
CORPUS/trace_manifest/manifest.json is the manifest of a two-stage trace written by the
transformers probe's trace writer (probes/glmcheck_probe/trace.py); CORPUS/shard_manifest/*.json
are shard manifests of two ranks, with and without hashes. Seeds stay a few KiB, so that
libFuzzer's default input size limit (the largest seed) stays small.
"""

import json
import tempfile

import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from glmcheck_oracle.formats.quant_blocks import random_blocks
from glmcheck_oracle.formats.write_gguf import add_metadata
from glmcheck_probe.trace import TraceWriter
from safetensors.torch import save_file


def gguf_seed(path: Path, types: list[Q], alignment: int | None, rng: np.random.Generator) -> None:
    """One GGUF of the oracle tests' metadata (every value type) and one two-row tensor per type."""
    w = GGUFWriter(path, arch="seed")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    add_metadata(w)
    for q in types:
        block, size = GGML_QUANT_SIZES[q]
        row_blocks = max(1, 32 // block)
        blocks = random_blocks(q, 2 * row_blocks, rng).reshape(2, row_blocks * size)
        w.add_tensor(f"blk.0.{q.name.lower()}.weight", blocks, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def safetensors_seed(path: Path, generator: torch.Generator) -> None:
    """F32, BF16 and I64 tensors and a block-scaled FP8 weight."""
    tensors = {
        "a.weight": torch.randn(2, 3, generator=generator),
        "b.weight": torch.randn(4, generator=generator).to(torch.bfloat16),
        "c.weight": torch.randn(2, 130, generator=generator).to(torch.float8_e4m3fn),
        "c.weight_scale_inv": torch.rand(1, 2, generator=generator),
        "d.ids": torch.arange(3, dtype=torch.int64),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})


def trace_seed(path: Path, rng: np.random.Generator) -> None:
    """The manifest.json of a trace holding an f32 and an i32 stage (one of them per rank)."""
    with tempfile.TemporaryDirectory() as tmp:
        header = {"producer": {"name": "seed"}, "model": {"source": "seed", "config": {},
                  "fingerprint": "0"}, "tokens": [1, 2], "backend": "cpu", "dtype": "f32",
                  "tp": 1}
        w = TraceWriter(tmp + "/seed.trace", header, full=["**"])
        w.record("embed", rng.standard_normal((2, 4)).astype(np.float32), "t d")
        w.record("L0.moe.topk_ids", np.array([[0, 1], [1, 0]], dtype=np.int32), "t k")
        w.finish()
        path.write_bytes(Path(tmp, "seed.trace", "manifest.json").read_bytes())


def shard_seed(path: Path, with_hash: bool) -> None:
    """A shard manifest of two ranks holding halves of one weight."""
    stats = {"count": 8, "mean": 0.1, "std": 1.0, "min": -2.0, "max": 2.0, "absmax": 2.0,
             "l2": 2.9}
    entry = {"name": "model.layers.0.self_attn.kv_b_proj.weight", "shape": [4, 2],
             "dtype": "bf16", "stats": stats}
    if with_hash:
        entry["hash"] = "0123456789abcdef"
    ranks = [{"rank": r, "weights": [entry]} for r in range(2)]
    path.write_text(json.dumps({"format": "glmcheck-shards", "version": 1, "producer": {},
                                "tp": 2, "ep": False, "ranks": ranks}))


def sglang_seeds(folder: Path) -> None:
    """Files as SGLang's dumper writes them: a bf16 tensor, a transposed f32 view, int64 ids."""
    meta = {"name": "non_intrusive__model.layers.0.self_attn.o_proj.output", "step": 0,
            "rank": 0, "dump_index": 1, "layer_id": 0, "world_rank": 0, "world_size": 1,
            "sglang_parallel_info": {"tp_rank": 0, "tp_size": 1, "attn_dp_enabled": False}}
    values = {"bf16.pt": torch.randn(2, 4).to(torch.bfloat16),
              "view.pt": torch.randn(3, 2).t(),
              "ids.pt": torch.arange(6, dtype=torch.int64)}
    for name, value in values.items():
        torch.save({"value": value, "meta": meta}, folder / name)


def main(corpus: Path) -> None:
    rng = np.random.default_rng(0)
    gguf_dir = corpus / "gguf_header"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf_seed(gguf_dir / "floats.gguf", [Q.F32, Q.F16, Q.BF16], None, rng)
    gguf_seed(gguf_dir / "legacy.gguf", [Q.Q4_0, Q.Q8_0, Q.IQ4_NL, Q.MXFP4], 64, rng)
    gguf_seed(gguf_dir / "kquants.gguf", [Q.Q4_K, Q.Q6_K], None, rng)
    gguf_seed(gguf_dir / "iquants.gguf", [Q.IQ2_XXS, Q.IQ4_XS], 16, rng)
    gguf_seed(gguf_dir / "metadata-only.gguf", [], None, rng)
    st_dir = corpus / "safetensors_header"
    st_dir.mkdir(parents=True, exist_ok=True)
    safetensors_seed(st_dir / "mixed.safetensors", torch.Generator().manual_seed(0))
    trace_dir = corpus / "trace_manifest"
    trace_dir.mkdir(parents=True, exist_ok=True)
    trace_seed(trace_dir / "manifest.json", rng)
    shard_dir = corpus / "shard_manifest"
    shard_dir.mkdir(parents=True, exist_ok=True)
    shard_seed(shard_dir / "stats.json", False)
    shard_seed(shard_dir / "hashed.json", True)
    sglang_dir = corpus / "sglang_dump"
    sglang_dir.mkdir(parents=True, exist_ok=True)
    sglang_seeds(sglang_dir)
    for d in (gguf_dir, st_dir, trace_dir, shard_dir, sglang_dir):
        for f in sorted(d.iterdir()):
            print(f"{f}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "corpus")
