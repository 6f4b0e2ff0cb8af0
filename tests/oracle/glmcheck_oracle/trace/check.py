"""Recompute the statistics and hashes of a glmcheck trace with numpy and the safetensors package.

Usage: python -m glmcheck_oracle.trace.check TRACE_DIR. Every stage that stores its tensor is
read with `safetensors.numpy`, its statistics recomputed (over finite values, in float64) and its
hash recomputed from the little-endian element bytes (the lane hash, word by word in plain
Python: a reference independent of glmcheck's and the probe's vectorized ones); any mismatch
exits non-zero.
Prints one JSON line: {"checked": N, "stats_only": M}.
"""

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file

MASK = (1 << 64) - 1
P1, P2, P3, P4, P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)  # xxHash64's primes
LANES = 256


def xxh_round(acc: int, word: int) -> int:
    acc = (acc + word * P2) & MASK
    return ((((acc << 31) | (acc >> 33)) & MASK) * P1) & MASK


def lane_hash(data: bytes) -> int:
    """Little-endian u64 words (the last zero-padded), word i into lane i mod 256 by xxHash64's
    round (lanes start at P1 + P2); then the byte count and the lanes merged as xxHash64 merges,
    and its avalanche."""
    lanes = [(P1 + P2) & MASK] * LANES
    for i in range(0, len(data), 8):
        word = int.from_bytes(data[i:i + 8].ljust(8, b"\0"), "little")
        lanes[i // 8 % LANES] = xxh_round(lanes[i // 8 % LANES], word)
    h = (P5 + len(data)) & MASK
    for lane in lanes:
        h = (((h ^ xxh_round(0, lane)) * P1) + P4) & MASK
    h ^= h >> 33
    h = (h * P2) & MASK
    h ^= h >> 29
    h = (h * P3) & MASK
    return h ^ (h >> 32)


# A stage's content hash: the lane hash of its bytes up to one piece; past that, the lane hash of
# the pieces' lane hashes, 8 little-endian bytes each.
PIECE = 1 << 20


def content_hash(data: bytes) -> int:
    if len(data) <= PIECE:
        return lane_hash(data)
    pieces = (lane_hash(data[i:i + PIECE]) for i in range(0, len(data), PIECE))
    return lane_hash(b"".join(h.to_bytes(8, "little") for h in pieces))


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
    assert manifest["version"] == 2, manifest["version"]
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
