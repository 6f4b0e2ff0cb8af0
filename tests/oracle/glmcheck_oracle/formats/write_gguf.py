"""Write a GGUF with gguf-py's GGUFWriter and describe what it holds, for tests/formats/gguf_oracle.rs.

OUTDIR/model.gguf      metadata of every value type (nested arrays too) and, for every type gguf-py
                       dequantizes, a 2-D tensor and a 3-D "stacked experts" tensor of random valid
                       blocks, plus glm-dsa indexer-named tensors
OUTDIR/expected.safetensors   gguf.quants.dequantize of every tensor (f32, logical shape)
OUTDIR/manifest.json   metadata as JSON and, per tensor, type id, shape and absolute data offset
                       as gguf-py's GGUFReader reads them back
OUTDIR/split/model-0000k-of-0000n.gguf   the same tensors as a split set (gguf-py's
                       split_max_tensors, as `convert_hf_to_gguf.py --split-max-tensors` writes)
"""

import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from safetensors.numpy import save_file

from glmcheck_oracle.formats.quant_blocks import random_blocks, supported_types


def add_metadata(w: GGUFWriter) -> None:
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_float32("test.f32", 0.1)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "Grüße, 世界")
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float64("test.f64", 1e-300)
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.strings", ["a", "", "ß"])
    w.add_array("test.nested", [[1, 2], [3]])


def tensors(rng: np.random.Generator):
    """(name, qtype, blocks reshaped to the byte shape) for every dequantizable type."""
    for q in supported_types():
        block, size = GGML_QUANT_SIZES[q]
        row_blocks = max(1, 64 // block)  # a row of 64 elements, or one block when blocks are bigger
        yield f"t2.{q.name}", q, random_blocks(q, 6 * row_blocks, rng).reshape(6, row_blocks * size)
        yield f"t3.{q.name}", q, random_blocks(q, 3 * 4 * row_blocks, rng).reshape(3, 4, row_blocks * size)
    yield "blk.0.indexer.attn_k.weight", GGMLQuantizationType.F32, rng.standard_normal((8, 64)).astype(np.float32).view(np.uint8)
    # More than glmcheck's 16 Mi-value chunk, so statistics span chunks.
    q8 = GGMLQuantizationType.Q8_0
    yield "big.Q8_0", q8, random_blocks(q8, 4100 * 128, rng).reshape(4100, 128 * GGML_QUANT_SIZES[q8][1])


def health(x: np.ndarray) -> dict:
    """What `glmcheck dequant` reports, computed in float64 numpy."""
    x = x.astype(np.float64).ravel()
    fin = x[np.isfinite(x)]
    mean, std = (float(fin.mean()), float(fin.std())) if fin.size else (0.0, 0.0)
    return {
        "count": int(x.size),
        "nan": int(np.isnan(x).sum()),
        "inf": int(np.isinf(x).sum()),
        "zeros": int((fin == 0).sum()),
        "mean": mean,
        "std": std,
        "absmax": float(np.abs(fin).max()) if fin.size else 0.0,
        "beyond_f16": int((np.abs(fin) > 65504).sum()),
        "outliers": int((np.abs(fin - mean) > 8 * std).sum()) if std > 0 else 0,
    }


def main(outdir: Path) -> None:
    rng = np.random.default_rng(7)
    path = outdir / "model.gguf"
    (outdir / "split").mkdir()
    w = GGUFWriter(path, arch="glm-dsa")
    split = GGUFWriter(outdir / "split" / "model.gguf", arch="glm-dsa", split_max_tensors=20)
    add_metadata(w)
    add_metadata(split)
    expected = {}
    for name, q, data in tensors(rng):
        w.add_tensor(name, data, raw_dtype=q)
        split.add_tensor(name, data, raw_dtype=q)
        expected[name] = np.ascontiguousarray(dequantize(data, q), dtype=np.float32)
    for writer in (w, split):
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    save_file(expected, str(outdir / "expected.safetensors"))
    r = GGUFReader(path)
    manifest = {
        # gguf-py flattens nested arrays in `contents()`; the test checks test.nested itself.
        "metadata": {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.") and f.name != "test.nested"},
        "tensors": [
            {"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in reversed(t.shape)], "offset": int(t.data_offset)}
            for t in r.tensors
        ],
    }
    manifest["health"] = {name: health(x) for name, x in expected.items()}
    (outdir / "manifest.json").write_text(json.dumps(manifest))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
