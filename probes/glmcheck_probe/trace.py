"""Write a glmcheck trace (docs/design.md §5) from Python, in exactly the format `src/trace/` reads.

Stages are grouped by layer (`L{n}.…`; any other stage is a group of its own). A group is written
when the next one starts and at `finish()`: its full tensors to `GROUP.safetensors`, then the
manifest with every finished group, each under a temporary name renamed into place, so a crashed
run leaves a readable trace that lacks at most the group in progress.

The statistics reproduce `TensorStats::of` bit for bit: sums run in float64 over fixed 64
Ki-element chunks whose partial results are added in chunk order; inside a chunk, element i adds
to lane i mod 16 (the values that are not finite add nothing), each lane left to right, then the
lanes in order (`np.cumsum` sums sequentially, unlike `np.sum`), so a Rust reader recomputing
them gets the same numbers.
"""

import hashlib
import json
import math
import os
import re

import numpy as np
from safetensors.numpy import save_file

FORMAT = "glmcheck-trace"
VERSION = 2
MANIFEST = "manifest.json"
DEFAULT_FULL = ("logits", "L*.out")
# Elements per chunk of the fixed summation order (the Rust `TASK`).
CHUNK = 1 << 16
# Lanes of a chunk's sums (the Rust `MOMENT_LANES`).
MOMENT_LANES = 16

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = (1 << 64) - 1
ELEM_TYPES = {np.dtype(np.float32): "f32", np.dtype(np.int32): "i32"}
STAGE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
LAYER = re.compile(r"^L[0-9]+$")


def fnv1a(data: bytes) -> int:
    """FNV-1a 64 over `data` (a shard manifest's hash, and a stage's of one piece)."""
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK64
    return h


# Bytes per piece of a stage's content hash (the Rust `HASH_PIECE_BYTES`).
HASH_PIECE = 1 << 20
# Lanes of the lane hash (the Rust `HASH_LANES`), and xxHash64's primes.
HASH_LANES = 256
P1, P2, P3, P4, P5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                      0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5)


def _round(acc, word):
    """xxHash64's round, on Python ints or (wrapping) on numpy uint64 arrays."""
    if isinstance(acc, int):
        acc = (acc + word * P2) & MASK64
        return ((((acc << 31) | (acc >> 33)) & MASK64) * P1) & MASK64
    acc = acc + word * np.uint64(P2)
    return ((acc << np.uint64(31)) | (acc >> np.uint64(33))) * np.uint64(P1)


def lane_hash(data: bytes) -> int:
    """glmcheck's lane hash: little-endian u64 words (the last zero-padded), word i into lane
    i mod 256 by xxHash64's round, the 256 lanes advanced side by side as numpy arrays; then the
    byte count and the lanes merged and avalanched as xxHash64 does."""
    n = len(data)
    words = np.frombuffer(bytes(data) + b"\0" * (-n % 8), dtype="<u8")
    lanes = np.full(HASH_LANES, (P1 + P2) & MASK64, dtype=np.uint64)
    rows = words.size // HASH_LANES
    with np.errstate(over="ignore"):
        for row in words[:rows * HASH_LANES].reshape(rows, HASH_LANES):
            lanes = _round(lanes, row)
        tail = words[rows * HASH_LANES:].astype(np.uint64)
        lanes[:tail.size] = _round(lanes[:tail.size], tail)
    h = (P5 + n) & MASK64
    for lane in lanes.tolist():
        h = (((h ^ _round(0, lane)) * P1) + P4) & MASK64
    h ^= h >> 33
    h = (h * P2) & MASK64
    h ^= h >> 29
    h = (h * P3) & MASK64
    return h ^ (h >> 32)


def content_hash(data: bytes) -> int:
    """A stage's content hash, as glmcheck computes it: the lane hash of the bytes up to one
    piece; past that, the lane hash of the pieces' lane hashes, 8 little-endian bytes each."""
    if len(data) <= HASH_PIECE:
        return lane_hash(data)
    pieces = (lane_hash(data[i:i + HASH_PIECE]) for i in range(0, len(data), HASH_PIECE))
    return lane_hash(b"".join(h.to_bytes(8, "little") for h in pieces))


def _sequential_sum(xs: np.ndarray) -> float:
    """Left-to-right float64 sum, the order Rust's fold uses."""
    return float(np.cumsum(xs)[-1]) if xs.size else 0.0


def tensor_stats(x: np.ndarray) -> dict:
    """The stats record of `x` (f32 or i32): moments over the finite values, the hash, and the
    sketch."""
    flat = np.ascontiguousarray(x).reshape(-1)
    stats = moments(flat)
    stats["hash"] = f"{content_hash(flat.astype(flat.dtype.newbyteorder('<'), copy=False).tobytes()):016x}"
    if flat.size:
        stats["sketch"] = sketch(flat)
    return stats


# src/trace/stats.rs `SKETCH_BUCKETS`.
SKETCH_BUCKETS = 32


def sketch_slots(start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket and sign (+1/-1) of elements start..start+count: SplitMix64 of each index, its
    low bits the bucket, its top bit the sign (`sketch_slot` in src/trace/stats.rs)."""
    z = np.arange(start + 1, start + count + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = z * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    buckets = (z % np.uint64(SKETCH_BUCKETS)).astype(np.intp)
    signs = np.where((z >> np.uint64(63)) == 1, -1.0, 1.0)
    return buckets, signs


def sketch(flat: np.ndarray) -> list[float]:
    """The finite values of `flat`, each with its sign into its bucket: `bincount` adds in
    index order within a chunk of CHUNK, and the chunks' buckets are added in chunk order, as
    `TensorStats::of` adds them, so the sketch is glmcheck's bit for bit."""
    v = flat.astype(np.float64)
    v[~np.isfinite(v)] = 0.0  # adds +0, which changes no bucket's sum
    total = np.zeros(SKETCH_BUCKETS)
    for start in range(0, v.size, CHUNK):
        part = v[start:start + CHUNK]
        buckets, signs = sketch_slots(start, part.size)
        total = total + np.bincount(buckets, weights=signs * part, minlength=SKETCH_BUCKETS)
    return [float(t) for t in total]


def _lane_sum(terms: np.ndarray) -> float:
    """`terms` (float64, the values that are not finite already 0) summed as `TensorStats::of`
    sums: per chunk of CHUNK, term i into lane i mod MOMENT_LANES, each lane left to right, then
    the lanes in order, then the chunks in order. The zeros that pad the last chunk's last row
    add nothing (a sum that starts at +0 is never -0)."""
    full = terms.size // CHUNK
    # `np.add.accumulate` adds strictly in order along its axis, unlike `np.sum`.
    chunks = terms[:full * CHUNK].reshape(full, CHUNK // MOMENT_LANES, MOMENT_LANES)
    rows = [np.add.accumulate(chunks, axis=1)[:, -1, :]]
    tail = terms[full * CHUNK:]
    if tail.size:
        padded = np.zeros(-(-tail.size // MOMENT_LANES) * MOMENT_LANES)
        padded[:tail.size] = tail
        rows.append(np.add.accumulate(padded.reshape(-1, MOMENT_LANES), axis=0)[-1:])
    lanes = np.concatenate(rows)
    return _sequential_sum(np.add.accumulate(lanes, axis=1)[:, -1]) if lanes.size else 0.0


def moments(x: np.ndarray) -> dict:
    """count, nan, inf, zeros, and mean, std, min, max, absmax, l2 over the finite values of `x`
    (summed in `TensorStats::of`'s order), without the hash."""
    v = np.ascontiguousarray(x).reshape(-1).astype(np.float64)
    finite = np.isfinite(v)
    n = int(np.count_nonzero(finite))
    every = n == v.size  # the common case: no masks needed
    nan = 0 if every else int(np.count_nonzero(np.isnan(v)))
    stats = {"count": int(v.size), "nan": nan, "inf": int(v.size) - n - nan,
             "zeros": int(np.count_nonzero(v == 0))}
    if n == 0:
        stats.update(mean=0.0, std=0.0, min=0.0, max=0.0, absmax=0.0, l2=0.0)
        return stats
    f = v if every else np.where(finite, v, 0.0)
    mean = _lane_sum(f) / n
    d = v - mean if every else np.where(finite, v - mean, 0.0)
    kept = v if every else v[finite]
    lo, hi = float(kept.min()), float(kept.max())
    stats.update(mean=mean, std=math.sqrt(_lane_sum(d * d) / n), min=lo, max=hi,
                 absmax=max(abs(lo), abs(hi)), l2=math.sqrt(_lane_sum(f * f)))
    return stats


def fingerprint(model_dir: str, config: dict) -> str:
    """sha256 of the config and the weight files' names and sizes: cheap, and different weights
    (another checkpoint, a re-quantization) almost always differ in one of them."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(os.listdir(model_dir)):
        if name.endswith((".safetensors", ".bin", ".gguf")):
            digest.update(f"\n{name} {os.path.getsize(os.path.join(model_dir, name))}".encode())
    return "sha256:" + digest.hexdigest()


def glob_regex(pattern: str) -> re.Pattern:
    """`--full` glob over dot-separated stage names: `*` stays in one part, `**` spans parts."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("^" + "".join(out) + "$")


def group_of(name: str) -> str:
    """The file group of a stage: its `L{n}` prefix, or the whole name outside the layers."""
    head = name.split(".", 1)[0]
    return head if LAYER.match(head) else name


def _write_renamed(path: str, write) -> None:
    """Have `write` fill `path.partial`, then rename it: `path` is absent, old, or complete."""
    tmp = path + ".partial"
    write(tmp)
    os.replace(tmp, path)


class TraceWriter:
    """An open trace being written: `record` stages in execution order, then `finish`."""

    def __init__(self, directory: str, header: dict, full=DEFAULT_FULL):
        """Start a trace in `directory`, which must be absent or empty (no stale tensor files).

        `header` holds producer, model, tokens, backend, dtype and tp.
        """
        os.makedirs(directory, exist_ok=True)
        if os.listdir(directory):
            raise FileExistsError(f"{directory} already holds files; give the trace a new name")
        self.dir = directory
        self.full = [glob_regex(p) for p in full]
        # "complete" stays false until `finish`: a killed run leaves a trace marked partial.
        self.manifest = {"format": FORMAT, "version": VERSION, **header, "complete": False,
                         "stages": []}
        self.group, self.stages, self.held = None, [], {}
        self.finished = set()
        self._write_manifest()

    def record(self, name: str, values: np.ndarray, dims: str, rank=None) -> None:
        """Record stage `name` (docs/design.md §4) with dims spec `dims`, whole or (`rank`) one
        tensor-parallel rank's part; f32 or i32 values."""
        if not STAGE_NAME.match(name):
            raise ValueError(f"stage name {name!r}: ASCII letters, digits, `.`, `_` or `-` only")
        values = np.ascontiguousarray(values)
        if values.dtype not in ELEM_TYPES:
            raise TypeError(f"stage {name}: {values.dtype} values, expected float32 or int32")
        group = group_of(name)
        if group in self.finished:
            raise ValueError(f"stage {name}: group {group} was already written")
        if any(s["name"] == name and s.get("rank") == rank for s in self.stages):
            which = "" if rank is None else f" rank {rank}"
            raise ValueError(f"stage {name}{which} recorded twice")
        if group != self.group:
            self._close_group()
            self.group = group
        stage = {"name": name, "shape": list(values.shape), "dtype": ELEM_TYPES[values.dtype],
                 "dims": dims}
        if rank is not None:
            stage["rank"] = int(rank)
        stage["stats"] = tensor_stats(values)
        if any(p.match(name) for p in self.full):
            tensor = name if rank is None else f"{name}@rank{rank}"
            self.held[tensor] = values
            stage.update(file=f"{group}.safetensors", tensor=tensor)
        self.stages.append(stage)

    def finish(self) -> dict:
        """Write the group in progress and the final manifest; the manifest as written."""
        self._close_group()
        self.manifest["complete"] = True
        self._write_manifest()
        return self.manifest

    def _close_group(self) -> None:
        if not self.stages:
            return
        if self.held:
            path = os.path.join(self.dir, f"{self.group}.safetensors")
            _write_renamed(path, lambda tmp: save_file(self.held, tmp))
        self.manifest["stages"].extend(self.stages)
        self.finished.add(self.group)
        self.stages, self.held = [], {}
        self._write_manifest()

    def _write_manifest(self) -> None:
        def write(tmp):
            with open(tmp, "w") as f:
                json.dump(self.manifest, f, indent=2)
                f.write("\n")
        _write_renamed(os.path.join(self.dir, MANIFEST), write)
