#!/usr/bin/env python3
"""The full GLM-5 on paper: per-layer time, bytes read and peak memory measured on `glm5-dims`
(GLM-5's real widths: one dense layer and one MoE layer of 256 experts, q4_k_m), projected to
the whole model (3 dense and 75 MoE layers, 402 GB of q4_k_m) with disk speed as a parameter.

    python3 benches/projection.py GLMCHECK OUT_DIR [--model FILE] [--tokens 8,64,512]
                                  [--sides cpu:2:f32,cpu:all:f32,cpu:all:bf16,cuda:1:f32,cuda:1:bf16]

A side is BACKEND:THREADS:DTYPE (THREADS: a number or `all`; for `cuda` the host threads are
left alone). Each (side, tokens) is one cold `glmcheck run` (no warm-up, nothing generated): what
each run of a bisect is. From its trace: the seconds of each layer (`producer.layer_seconds`),
the rest of the wall time (start, embedding, final norm, the head over 154880 rows, trace
writing: the same for the full model, which has the same vocabulary and width), the process's
peak RSS (os.wait4) and, on a GPU, the peak GPU memory and the upload seconds.

Writes OUT_DIR/projection.json (the measurements) and OUT_DIR/projection.md (the measured rows
and the projection). Without --model it writes the model into OUT_DIR first (about 9 GB) and
deletes it after.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FULL_DENSE, FULL_MOE, FULL_BYTES = 3, 75, 402e9
DISKS = (1.0, 3.0, 7.0)  # GB/s: a SATA SSD, one NVMe drive, a striped pair


def measure(cmd: list, env: dict) -> dict:
    """Wall seconds and this child's own peak RSS (GiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{err}")
    return {"wall": time.perf_counter() - start, "rss_gib": usage.ru_maxrss / 2**20}


def layer_bytes(glmcheck: str, model: Path) -> dict:
    """Bytes each layer's tensors take in the file, and the head's (output and its norm)."""
    out = subprocess.run([glmcheck, "inspect", model, "--json"], capture_output=True, text=True,
                         check=True)
    sizes = {}
    for t in json.loads(out.stdout)["tensors"]:
        parts = t["name"].split(".")
        key = f"L{parts[1]}" if parts[0] == "blk" else ("head" if parts[0].startswith("output") else None)
        if key:
            sizes[key] = sizes.get(key, 0) + t["bytes"]
    return sizes


def run_side(glmcheck: str, model: Path, side: str, tokens: int, out: Path) -> dict:
    backend, threads, dtype = side.split(":")
    env = dict(os.environ)
    if threads != "all" and backend == "cpu":
        env["RAYON_NUM_THREADS"] = threads
    trace = out / f"{backend}-{threads}-{dtype}-{tokens}.trace"
    shutil.rmtree(trace, ignore_errors=True)
    ids = ",".join(str((i * 37 + 11) % 383) for i in range(tokens))  # within every preset's vocabulary
    m = measure([glmcheck, "run", model, "--backend", backend, "--dtype", dtype, "--tokens", ids,
                 "--out", trace], env)
    producer = json.loads((trace / "manifest.json").read_text())["producer"]
    seconds = producer.get("layer_seconds", {})
    layers = {k: v for k, v in seconds.items() if "." not in k}
    shutil.rmtree(trace)
    return {"side": side, "tokens": tokens, "wall": m["wall"], "rss_gib": m["rss_gib"],
            "layer_seconds": seconds, "rest": m["wall"] - sum(layers.values()),
            "gpu_peak_gib": max(producer.get("gpu_peak_bytes", [0])) / 2**30,
            "gpu_load_seconds": sum(producer.get("gpu_load_seconds", [0]))}


def projected(row: dict, dense: str, moe: str, disk: float) -> float:
    """Seconds of one cold run of the full model: the rest, 3 dense and 75 MoE layers as
    measured, and the whole file read once at `disk` GB/s (reading and computing are not
    overlapped: each weight is read when its op needs it)."""
    s = row["layer_seconds"]
    return row["rest"] + FULL_DENSE * s[dense] + FULL_MOE * s[moe] + FULL_BYTES / (disk * 1e9)


def table(headers: list, rows: list) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def main() -> int:
    glmcheck, out = sys.argv[1], Path(sys.argv[2])
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2]))
    out.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in opts.get("--tokens", "8,64,512").split(",")]
    sides = opts.get("--sides", "cpu:2:f32,cpu:all:f32,cpu:all:bf16,cuda:1:f32,cuda:1:bf16").split(",")
    model = Path(opts["--model"]) if "--model" in opts else out / "glm5-dims-2.gguf"
    written = "--model" not in opts
    if written:
        subprocess.run([glmcheck, "synth", "--preset", "glm5-dims", "--layers", "2", "--set",
                        "first_k_dense_replace=1", "--fast", "--quant", "q4_k_m", "--out", model],
                       check=True, stdout=subprocess.DEVNULL)
    sizes = layer_bytes(glmcheck, model)
    rows = []
    try:
        for side in sides:
            for t in tokens:
                row = run_side(glmcheck, model, side, t, out)
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if written:
            model.unlink()
    result = {"cores": os.cpu_count(), "file_bytes": sum(sizes.values()), "layer_bytes": sizes,
              "rows": rows}
    (out / "projection.json").write_text(json.dumps(result, indent=1))
    (out / "projection.md").write_text(render(result) + "\n")
    print(render(result))
    return 0


def render(result: dict) -> str:
    sizes = result["layer_bytes"]
    measured = [(r["side"], r["tokens"], f"{r['layer_seconds']['L0']:.3f}",
                 f"{r['layer_seconds']['L1']:.3f}", f"{r['layer_seconds'].get('L1.ffn', 0):.3f}",
                 f"{r['rest']:.2f}", f"{r['wall']:.2f}", f"{r['rss_gib']:.2f}",
                 f"{r['gpu_peak_gib']:.2f}" if r["gpu_peak_gib"] else "-") for r in result["rows"]]
    text = [f"Measured on {result['cores']} cores; layer bytes in the file: dense "
            f"{sizes['L0'] / 1e9:.2f} GB, MoE {sizes['L1'] / 1e9:.2f} GB, head {sizes.get('head', 0) / 1e9:.2f} GB.\n",
            table(["side", "tokens", "dense layer s", "MoE layer s", "of which experts s", "rest s",
                   "wall s", "peak RSS GiB", "peak GPU GiB"], measured), "",
            "Projected cold run of the full model (3 dense + 75 MoE layers, 402 GB read once), seconds:\n"]
    heads = ["side", "tokens", "compute"] + [f"read at {d:g} GB/s" for d in DISKS]
    proj = [(r["side"], r["tokens"], f"{projected(r, 'L0', 'L1', float('inf')):.0f}",
             *(f"{projected(r, 'L0', 'L1', d):.0f}" for d in DISKS)) for r in result["rows"]]
    text.append(table(heads, proj))
    return "\n".join(text)


if __name__ == "__main__":
    sys.exit(main())
