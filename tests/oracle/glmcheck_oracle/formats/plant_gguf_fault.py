"""Plant a fault in the stored bytes of one tensor of a GGUF, leaving every other byte as it was.

Usage: python -m glmcheck_oracle.formats.plant_gguf_fault IN.gguf OUT.gguf FAULT TENSOR [ARGS...]

IN may be the first file of a split set (`NAME-00001-of-0000N.gguf`); OUT must then be named
the same way: every file of the set is copied to OUT's name, and the fault goes into the one
that holds TENSOR.

OUT is a byte-for-byte copy of IN in which only bytes of the named tensor's data are rewritten in
place (offsets, types and shapes from gguf-py's GGUFReader; the file is never re-serialized, so
metadata, alignment and every other tensor stay identical). Faults work on the stored blocks of
the tensor's GGML type:

  swap-experts TENSOR E1 E2         swap experts E1 and E2 of a stacked [E, rows, cols] tensor
  swap-heads TENSOR H1 H2           swap heads H1 and H2 of a [heads, rows, cols] tensor
  scale TENSOR FACTOR               multiply every f16 block scale by FACTOR (d and dmin of
                                    Q4_K/Q5_K/Q2_K, d and m of Q4_1/Q5_1, d of the others);
                                    F32/F16/BF16: every value
  zero-blocks TENSOR ROW FIRST COUNT  zero COUNT blocks from block FIRST of row ROW
  nan-scale TENSOR ROW BLOCK        the block's f16 d becomes NaN (0x7E00); floats: one value
  copy-rows TENSOR FROM ROW0 COUNT  rows ROW0..ROW0+COUNT get FROM's same rows (same type and
                                    row length)
  garbage TENSOR ROW FIRST COUNT SEED  random quant codes in COUNT blocks from there, scales kept
                                    (so every value stays finite); floats: uniform random values
                                    within the largest magnitude of those they replace
  zero TENSOR                       every byte zero
  untranspose-heads TENSOR          F32/F16/BF16 [heads, a, b]: each head's a x b values written
                                    in b x a (transposed) order under the same shape
  swap-tensors TENSOR OTHER         the stored bytes of two tensors of one type and shape
                                    exchanged (a converter's gate/up or K/V order bug)

A row is ne[0] values (a GGUF row, numpy's last axis); rows are counted over the whole tensor
(row r of expert e of a [E, rows, cols] tensor is e * rows + r); COUNT blocks that do not fit in
the row run on into the next rows; for float types a block is one value. Quantized types: Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; floats: F32, F16, BF16.
Others are refused.

Prints one line of JSON: the fault, tensor, type, GGUF shape (ne order), the file byte ranges
[start, end) rewritten, how many bytes differ, and `check`: the effect measured by dequantizing
the tensor before and after with gguf-py (e.g. `max_abs_vs_scaled`, 0 when the planted tensor is
exactly FACTOR times the honest one), with `confirmed`: whether it shows the intended effect.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGMLQuantizationType as Q
from gguf.quants import dequantize

# Per quantized type: byte offsets of the f16 scales in a block (the first is `d`), and the byte
# ranges of its quant codes (what `garbage` randomizes; sub-block scales are left out), from the
# block layouts gguf-py's quants.py dequantizes.
LAYOUT: dict[Q, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = {
    Q.Q4_0: ((0,), ((2, 18),)),  # d, qs[16]
    Q.Q4_1: ((0, 2), ((4, 20),)),  # d, m, qs[16]
    Q.Q5_0: ((0,), ((2, 22),)),  # d, qh[4], qs[16]
    Q.Q5_1: ((0, 2), ((4, 24),)),  # d, m, qh[4], qs[16]
    Q.Q8_0: ((0,), ((2, 34),)),  # d, qs[32]
    Q.Q2_K: ((80, 82), ((16, 80),)),  # scales[16], qs[64], d, dmin
    Q.Q3_K: ((108,), ((0, 96),)),  # hmask[32], qs[64], scales[12], d
    Q.Q4_K: ((0, 2), ((16, 144),)),  # d, dmin, scales[12], qs[128]
    Q.Q5_K: ((0, 2), ((16, 176),)),  # d, dmin, scales[12], qh[32], qs[128]
    Q.Q6_K: ((208,), ((0, 192),)),  # ql[128], qh[64], scales[16], d
    Q.IQ4_NL: ((0,), ((2, 18),)),  # d, qs[16]
    Q.IQ4_XS: ((0,), ((8, 136),)),  # d, scales_h, scales_l[4], qs[128]
}
FLOATS = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: None}
NAN_F16 = 0x7E00
NAN_BF16 = 0x7FC0


def fail(msg: str):
    raise SystemExit(f"plant_gguf_fault: {msg}")


class Tensor:
    """One tensor of the reader: its file offset, type, shape and row geometry."""

    def __init__(self, reader: GGUFReader, name: str):
        found = [t for t in reader.tensors if t.name == name]
        if not found:
            fail(f"no tensor {name!r} in the file")
        t = found[0]
        self.name = name
        self.type = Q(t.tensor_type)
        if self.type not in LAYOUT and self.type not in FLOATS:
            fail(f"{name} is {self.type.name}, a type this script does not plant faults in")
        self.ne = [int(d) for d in t.shape]  # GGUF order: ne[0] is the row length
        self.offset = int(t.data_offset)
        self.n_bytes = int(t.n_bytes)
        self.block_size, self.type_size = GGML_QUANT_SIZES[self.type]
        self.blocks_per_row = self.ne[0] // self.block_size
        self.row_bytes = self.blocks_per_row * self.type_size
        self.rows = self.n_bytes // self.row_bytes

    @property
    def is_float(self) -> bool:
        return self.type in FLOATS

    def read(self, f) -> bytearray:
        f.seek(self.offset)
        data = bytearray(f.read(self.n_bytes))
        if len(data) != self.n_bytes:
            fail(f"{self.name}: the file ends inside the tensor")
        return data

    def values(self, data) -> np.ndarray:
        """gguf-py's dequantization, as float32 of numpy shape (reversed ne)."""
        raw = np.frombuffer(bytes(data), dtype=np.uint8).reshape(self.rows, self.row_bytes)
        if self.type == Q.BF16:
            v = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            v = dequantize(raw, self.type)
        return np.asarray(v, dtype=np.float32).reshape(list(reversed(self.ne)))

    def blocks(self, row: int, block: int, count: int = 1) -> tuple[int, int]:
        """Blocks [first, end) of the whole tensor: `count` blocks from block `block` of row
        `row`, running on into the next rows when a row has fewer."""
        if not 0 <= row < self.rows:
            fail(f"{self.name} has {self.rows} rows, no row {row}")
        if not 0 <= block < self.blocks_per_row:
            fail(f"{self.name} has {self.blocks_per_row} blocks a row, no block {block}")
        first = row * self.blocks_per_row + block
        if count < 1 or first + count > self.rows * self.blocks_per_row:
            fail(f"{self.name}: {count} blocks from row {row} block {block} run past the tensor")
        return first, first + count

    def slab(self, index: int, what: str) -> tuple[int, int]:
        """Byte range of one index of the outermost dimension of a 3-D tensor."""
        if len(self.ne) != 3:
            fail(f"{self.name} has shape {self.ne}, not [{what}, rows, cols]")
        if not 0 <= index < self.ne[2]:
            fail(f"{self.name} has {self.ne[2]} {what}s, no {what} {index}")
        size = self.n_bytes // self.ne[2]
        return index * size, (index + 1) * size


def float_codec(t: Tensor):
    """(decode, encode) between a float tensor's bytes and float32 numpy values."""
    if t.type == Q.BF16:

        def decode(b):
            return (np.frombuffer(bytes(b), dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)

        def encode(v):
            u = np.asarray(v, dtype=np.float32).view(np.uint32)
            # round to nearest even, as a converter writes BF16
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            return u.astype(np.uint16).tobytes()

        return decode, encode
    dtype = FLOATS[t.type]
    return (lambda b: np.frombuffer(bytes(b), dtype=dtype).astype(np.float32)), (
        lambda v: np.asarray(v, dtype=np.float32).astype(dtype).tobytes()
    )


def swap(data: bytearray, a: tuple[int, int], b: tuple[int, int]) -> list:
    data[a[0] : a[1]], data[b[0] : b[1]] = bytes(data[b[0] : b[1]]), bytes(data[a[0] : a[1]])
    return [a, b]


def plant(f, t: Tensor, fault: str, args: list[str], data: bytearray, reader: GGUFReader):
    """Rewrite `data` (the tensor's bytes) in place; return the byte ranges rewritten (inside the
    tensor) and the effect on its values, dequantized before and after."""
    before = bytes(data)
    old = t.values(before)

    def need(n: int, usage: str):
        if len(args) != n:
            fail(f"{fault} takes {usage}")

    if fault in ("swap-experts", "swap-heads"):
        need(2, "TENSOR I J")
        what = "expert" if fault == "swap-experts" else "head"
        i, j = int(args[0]), int(args[1])
        if i == j:
            fail(f"{what}s {i} and {j} are the same")
        ranges = swap(data, t.slab(i, what), t.slab(j, what))
        new = t.values(data)
        perm = list(range(t.ne[2]))
        perm[i], perm[j] = j, i
        return ranges, {f"equals_{what}_permutation": bool(np.array_equal(new, old[perm], equal_nan=True))}

    if fault == "scale":
        need(1, "TENSOR FACTOR")
        factor = float(args[0])
        if t.is_float:
            decode, encode = float_codec(t)
            data[:] = encode(decode(data) * np.float32(factor))
            ranges = [(0, t.n_bytes)]
        else:
            offsets, _ = LAYOUT[t.type]
            blocks = np.frombuffer(bytes(data), dtype=np.uint8).reshape(-1, t.type_size).copy()
            for o in offsets:
                d = blocks[:, o : o + 2].copy().view(np.float16).astype(np.float32)
                blocks[:, o : o + 2] = (d * np.float32(factor)).astype(np.float16).view(np.uint8)
            data[:] = blocks.tobytes()
            ranges = [(b * t.type_size + o, b * t.type_size + o + 2) for b in range(len(blocks)) for o in offsets]
        new = t.values(data)
        dev = np.abs(new.astype(np.float64) - factor * old.astype(np.float64))
        return ranges, {
            "factor": factor,
            "max_abs_vs_scaled": float(dev.max()),
            "max_abs_honest": float(np.abs(old).max()),
            "finite": bool(np.isfinite(new).all()),
        }

    if fault == "zero-blocks":
        need(3, "TENSOR ROW FIRST_BLOCK COUNT")
        b0, b1 = t.blocks(*(int(a) for a in args))
        s, e = b0 * t.type_size, b1 * t.type_size
        data[s:e] = bytes(e - s)
        new, honest = t.values(data).ravel(), old.ravel()
        lo, hi = b0 * t.block_size, b1 * t.block_size
        return [(s, e)], {
            "values_zeroed": int(hi - lo),
            "all_zero": bool((new[lo:hi] == 0).all()),
            "honest_max_abs": float(np.abs(honest[lo:hi]).max()),
            "rest_unchanged": rest_unchanged(new, honest, lo, hi),
        }

    if fault == "nan-scale":
        need(2, "TENSOR ROW BLOCK")
        row, block = int(args[0]), int(args[1])
        s = t.blocks(row, block)[0] * t.type_size
        if t.is_float:
            w = t.type_size
            if t.type == Q.F32:
                data[s : s + w] = np.array([np.nan], dtype=np.float32).tobytes()
            else:
                data[s : s + w] = (NAN_F16 if t.type == Q.F16 else NAN_BF16).to_bytes(2, "little")
        else:
            s += LAYOUT[t.type][0][0]
            w = 2
            data[s : s + w] = NAN_F16.to_bytes(2, "little")
        new = t.values(data)
        return [(s, s + w)], {"nan_values": int(np.isnan(new).sum()), "block_size": t.block_size}

    if fault == "copy-rows":
        need(3, "TENSOR FROM_TENSOR ROW0 COUNT")
        src = Tensor(reader, args[0])
        row0, count = int(args[1]), int(args[2])
        if src.type != t.type or src.ne[0] != t.ne[0]:
            fail(f"{src.name} is {src.type.name} rows of {src.ne[0]}, {t.name} {t.type.name} rows of {t.ne[0]}")
        if count < 1 or row0 < 0 or row0 + count > min(t.rows, src.rows):
            fail(f"rows {row0}..{row0 + count} are not in both tensors ({t.rows} and {src.rows} rows)")
        s, e = row0 * t.row_bytes, (row0 + count) * t.row_bytes
        data[s:e] = src.read(f)[s:e]
        rows = slice(row0, row0 + count)
        new, honest = t.values(data).reshape(t.rows, t.ne[0]), old.reshape(t.rows, t.ne[0])
        theirs = src.values(src.read(f)).reshape(src.rows, src.ne[0])
        return [(s, e)], {
            "rows_equal_source": bool(np.array_equal(new[rows], theirs[rows])),
            "rows_differed_before": int((honest[rows] != theirs[rows]).any(axis=1).sum()),
            "rest_unchanged": rest_unchanged(new.ravel(), honest.ravel(), row0 * t.ne[0], (row0 + count) * t.ne[0]),
        }

    if fault == "garbage":
        need(4, "TENSOR ROW FIRST_BLOCK COUNT SEED")
        row, first, count, seed = (int(a) for a in args)
        b0, b1 = t.blocks(row, first, count)
        lo, hi = b0 * t.block_size, b1 * t.block_size
        rng = np.random.default_rng(seed)
        ranges = []
        if t.is_float:
            _, encode = float_codec(t)
            m = float(np.abs(old.ravel()[lo:hi]).max()) or 1.0
            s, e = b0 * t.type_size, b1 * t.type_size
            data[s:e] = encode(rng.uniform(-m, m, hi - lo).astype(np.float32))
            ranges.append((s, e))
        else:
            _, payload = LAYOUT[t.type]
            for b in range(b0, b1):
                for p0, p1 in payload:
                    s = b * t.type_size
                    data[s + p0 : s + p1] = rng.integers(0, 256, p1 - p0, dtype=np.uint8).tobytes()
                    ranges.append((s + p0, s + p1))
        new, honest = t.values(data).ravel(), old.ravel()
        was, now = honest[lo:hi], new[lo:hi]
        return ranges, {
            "values_changed": int((now != was).sum()),
            "values": int(hi - lo),
            "finite": bool(np.isfinite(new).all()),
            "rel_diff_blocks": float(np.linalg.norm(now - was) / (np.linalg.norm(was) or 1.0)),
            "rest_unchanged": rest_unchanged(new, honest, lo, hi),
        }

    if fault == "zero":
        need(0, "TENSOR")
        data[:] = bytes(t.n_bytes)
        return [(0, t.n_bytes)], {"all_zero": bool((t.values(data) == 0).all())}

    if fault == "untranspose-heads":
        need(0, "TENSOR")
        if not t.is_float:
            fail(f"untranspose-heads needs F32, F16 or BF16; {t.name} is {t.type.name}")
        if len(t.ne) != 3:
            fail(f"{t.name} has shape {t.ne}, not [heads, a, b]")
        heads, a, b = t.ne[2], t.ne[1], t.ne[0]
        w = t.type_size
        raw = np.frombuffer(before, dtype=np.uint8).reshape(heads, a, b, w)
        data[:] = np.ascontiguousarray(raw.transpose(0, 2, 1, 3)).tobytes()
        new = t.values(data)
        return [(0, t.n_bytes)], {
            "heads": heads,
            "square": a == b,
            "equals_heads_transposed": bool(
                np.array_equal(new.reshape(heads, b, a), old.transpose(0, 2, 1), equal_nan=True)
            ),
        }

    fail(f"unknown fault {fault!r}")


def confirmed(fault: str, c: dict) -> bool:
    """Whether the dequantized check shows the effect the fault is meant to have."""
    if fault in ("swap-experts", "swap-heads"):
        return any(v for k, v in c.items() if k.endswith("_permutation"))
    if fault == "scale":
        # exact for a power of two; else within the f16 rounding of each scale
        f = c["factor"]
        exact = f != 0 and float(np.log2(abs(f))).is_integer()
        bound = 0.0 if exact else abs(f) * c["max_abs_honest"] * 2.0**-10
        return c["finite"] and c["max_abs_vs_scaled"] <= bound
    if fault == "zero-blocks":
        return c["all_zero"] and c["rest_unchanged"]
    if fault == "nan-scale":
        return c["nan_values"] == c["block_size"]
    if fault == "copy-rows":
        return c["rows_equal_source"] and c["rest_unchanged"] and c["rows_differed_before"] > 0
    if fault == "garbage":
        return c["finite"] and c["rest_unchanged"] and c["values_changed"] > 0
    if fault == "zero":
        return c["all_zero"]
    return c["equals_heads_transposed"]


def rest_unchanged(new: np.ndarray, old: np.ndarray, lo: int, hi: int) -> bool:
    """Whether two flat value arrays agree outside [lo, hi) (NaN equal to NaN)."""
    return bool(np.array_equal(new[:lo], old[:lo], equal_nan=True) and np.array_equal(new[hi:], old[hi:], equal_nan=True))


def coalesce(ranges) -> list[list[int]]:
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


SPLIT = re.compile(r"^(.*)-00001-of-(\d{5})\.gguf$")


def split_member(src: str, dst: str, name: str) -> tuple[str, str]:
    """For a split set: every file copied to DST's name, and the pair that holds NAME."""
    m, n = SPLIT.match(src), SPLIT.match(dst)
    if not m:
        return src, dst
    if not n or n.group(2) != m.group(2):
        fail(f"{dst}: a split set's copy must be named NAME-00001-of-{m.group(2)}.gguf")
    total = int(m.group(2))
    pairs = [(f"{m.group(1)}-{i:05d}-of-{total:05d}.gguf", f"{n.group(1)}-{i:05d}-of-{total:05d}.gguf")
             for i in range(1, total + 1)]
    holder = None
    for a, b in pairs:
        shutil.copyfile(a, b)
        if holder is None and any(t.name == name for t in GGUFReader(a).tensors):
            holder = (a, b)
    if holder is None:
        fail(f"{src}: no file of the set holds {name}")
    return holder


def swap_tensors(src: str, dst: str, reader: GGUFReader, t: Tensor, args: list[str]) -> None:
    """Exchange the stored bytes of `t` and the tensor `args[0]` in a copy of `src`."""
    if len(args) != 1:
        fail("swap-tensors takes TENSOR OTHER")
    other = Tensor(reader, args[0])
    if other.name == t.name:
        fail(f"{t.name} is swapped with itself")
    if other.type != t.type or other.ne != t.ne:
        fail(f"{t.name} is {t.type.name} {t.ne}, {other.name} {other.type.name} {other.ne}")
    with open(src, "rb") as f:
        mine, theirs = t.read(f), other.read(f)
    before_mine, before_theirs = t.values(mine), other.values(theirs)
    del reader
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(t.offset)
        f.write(theirs)
        f.seek(other.offset)
        f.write(mine)
    with open(dst, "rb") as f:
        after_mine, after_theirs = t.values(t.read(f)), other.values(other.read(f))
    check = {
        "holds_other": bool(np.array_equal(after_mine, before_theirs, equal_nan=True)),
        "other_holds_it": bool(np.array_equal(after_theirs, before_mine, equal_nan=True)),
        "differed_before": bool(not np.array_equal(before_mine, before_theirs, equal_nan=True)),
    }
    check["confirmed"] = all(check.values())
    print(json.dumps({"fault": "swap-tensors", "args": args, "tensor": t.name, "type": t.type.name,
                      "shape": t.ne, "bytes_changed": 2 * t.n_bytes, "check": check}))


def main() -> None:
    if len(sys.argv) < 5:
        fail("usage: python -m glmcheck_oracle.formats.plant_gguf_fault "
             "IN.gguf OUT.gguf FAULT TENSOR [ARGS...]")
    src, dst, fault, name, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
    src, dst = split_member(src, dst, name)
    reader = GGUFReader(src)
    t = Tensor(reader, name)
    if fault == "swap-tensors":
        swap_tensors(src, dst, reader, t, args)
        return
    with open(src, "rb") as f:
        data = t.read(f)
        before = np.frombuffer(bytes(data), dtype=np.uint8)
        ranges, check = plant(f, t, fault, args, data, reader)
    check["confirmed"] = confirmed(fault, check)
    del reader
    after = np.frombuffer(bytes(data), dtype=np.uint8)
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(t.offset)
        f.write(data)
    spans = coalesce(ranges)
    print(
        json.dumps(
            {
                "fault": fault,
                "args": args,
                "tensor": t.name,
                "type": t.type.name,
                "shape": t.ne,
                "data_offset": t.offset,
                "n_bytes": t.n_bytes,
                "bytes_changed": int((before != after).sum()),
                "ranges_total": len(spans),
                "ranges": [[t.offset + s, t.offset + e] for s, e in spans[:16]],
                "check": check,
            }
        )
    )


if __name__ == "__main__":
    main()
