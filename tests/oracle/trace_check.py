"""Recompute the statistics and hashes of a glmcheck trace with numpy and the safetensors package.

Usage: trace_check.py TRACE_DIR. Every stage that stores its tensor is read with
`safetensors.numpy`, its statistics recomputed (over finite values, in float64) and its hash
recomputed as FNV-1a 64 over the little-endian element bytes; any mismatch exits non-zero.
Prints one JSON line: {"checked": N, "stats_only": M}.
"""

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK = (1 << 64) - 1


def fnv1a(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


# A stage's content hash: FNV-1a 64 of its bytes up to one piece; past that, FNV-1a 64 of the
# pieces' FNV-1a 64 hashes, 8 little-endian bytes each.
PIECE = 1 << 20


def content_hash(data: bytes) -> int:
    if len(data) <= PIECE:
        return fnv1a(data)
    pieces = (fnv1a(data[i:i + PIECE]) for i in range(0, len(data), PIECE))
    return fnv1a(b"".join(h.to_bytes(8, "little") for h in pieces))


def stats(x: np.ndarray) -> dict:
    v = x.astype(np.float64).ravel()
    fin = v[np.isfinite(v)]
    out = {
        "count": int(v.size),
        "nan": int(np.isnan(v).sum()),
        "inf": int(np.isinf(v).sum()),
        "zeros": int((fin == 0).sum()),
    }
    if fin.size:
        out.update(mean=fin.mean(), std=fin.std(), min=fin.min(), max=fin.max(),
                   absmax=np.abs(fin).max(), l2=math.sqrt((fin * fin).sum()))
    else:
        out.update(mean=0.0, std=0.0, min=0.0, max=0.0, absmax=0.0, l2=0.0)
    le = x.astype(x.dtype.newbyteorder("<"), copy=False)
    out["hash"] = f"{content_hash(le.tobytes()):016x}"
    return out


def close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def main() -> None:
    trace = sys.argv[1]
    with open(os.path.join(trace, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["format"] == "glmcheck-trace", manifest["format"]
    assert manifest["version"] == 1, manifest["version"]
    files = {}
    checked = stats_only = 0
    for s in manifest["stages"]:
        label = f'{s["name"]} rank {s.get("rank")}'
        if "file" not in s:
            assert "tensor" not in s, label
            stats_only += 1
            continue
        if s["file"] not in files:
            files[s["file"]] = load_file(os.path.join(trace, s["file"]))
        x = files[s["file"]][s["tensor"]]
        assert list(x.shape) == s["shape"], (label, x.shape, s["shape"])
        want = {"f32": np.float32, "f64": np.float64, "i32": np.int32}[s["dtype"]]
        assert x.dtype == want, (label, x.dtype)
        got, ours = stats(x), s["stats"]
        for key in ("count", "nan", "inf", "zeros", "min", "max", "absmax", "hash"):
            assert got[key] == ours[key], (label, key, got[key], ours[key])
        for key in ("mean", "std", "l2"):
            assert close(got[key], ours[key]), (label, key, got[key], ours[key])
        checked += 1
    print(json.dumps({"checked": checked, "stats_only": stats_only}))


if __name__ == "__main__":
    main()
