#!/usr/bin/env python3
"""Speed and memory of `glmcheck verify` on GLM-5's real widths.

    python3 benches/verify.py [--glmcheck target/release/glmcheck] [--layers 2,4] [--experts 16]
                              [--threads 2,16] [--exact] [--baseline OTHER_GLMCHECK]

Why: verify reads every byte of a candidate checkpoint and re-quantizes the reference's values
of every tensor, so its rate decides whether a 402 GB GGUF can be checked at all, and its peak
memory must stay at one unit (an expert, a block of rows) whatever the model's depth.

For each layer count: `glmcheck synth --preset glm5-dims` writes the f32 GGUF (the reference)
and the q4_k_m GGUF quantized from the same weights (the candidate); `glmcheck verify` of one
against the other is timed (wall, CPU, peak RSS of the child, os.wait4) with the page cache
warm (a first untimed `cat` of both files), once per thread count (`RAYON_NUM_THREADS`), with
`--exact` too when asked (every block re-quantized), and with a `--baseline` binary (another
build, for a before/after table). The rate is candidate GB per second and reference + candidate
GB per second. The files are written to a temporary folder and deleted in turn (the
f32 reference of 4 layers is tens of GB). The Markdown table goes to bench-results/verify.md and
to stdout.
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list, env: dict = None) -> dict:
    """`cmd` to completion: wall and CPU seconds, peak RSS (MiB), exit code and stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    with proc.stdout:
        out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    return {"wall": time.perf_counter() - start, "cpu": usage.ru_utime + usage.ru_stime,
            "rss": usage.ru_maxrss / 1024, "code": os.waitstatus_to_exitcode(status), "out": out}


def synth(glmcheck: str, out: Path, layers: int, experts: int, quant: str) -> None:
    r = run([glmcheck, "synth", "--preset", "glm5-dims", "--layers", str(layers), "--experts",
             str(experts), "--set", "first_k_dense_replace=1", "--quant", quant, "--out", str(out)])
    if r["code"] != 0:
        raise SystemExit(f"synth {quant} failed")


def warm(*paths: Path) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--glmcheck", default=str(ROOT / "target/release/glmcheck"))
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--threads", default=str(os.cpu_count()))
    ap.add_argument("--exact", action="store_true", help="also time `verify --exact`")
    ap.add_argument("--baseline", help="another glmcheck binary timed the same way")
    args = ap.parse_args()
    builds = [("this", args.glmcheck)] + ([("baseline", args.baseline)] if args.baseline else [])
    modes = [[]] + ([["--exact"]] if args.exact else [])
    rows = []
    for layers in [int(n) for n in args.layers.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            ref, cand = Path(tmp) / "f32.gguf", Path(tmp) / "q4_k_m.gguf"
            synth(args.glmcheck, ref, layers, args.experts, "f32")
            synth(args.glmcheck, cand, layers, args.experts, "q4_k_m")
            gb_c, gb_r = cand.stat().st_size / 1e9, ref.stat().st_size / 1e9
            for threads in [int(n) for n in args.threads.split(",")]:
                for build, binary in builds:
                    for mode in modes:
                        warm(ref, cand)
                        r = run([binary, "verify", str(ref), str(cand), "--json", *mode],
                                {"RAYON_NUM_THREADS": str(threads)})
                        if r["code"] != 0:
                            raise SystemExit(f"verify of an honest quantization failed ({r['code']})")
                        s = json.loads(r["out"])["summary"]
                        what = build + (" --exact" if mode else "")
                        rows.append((layers, args.experts, gb_r, gb_c, threads, what, s, r))
                        print(rows[-1][:6], f"{r['wall']:.1f} s", flush=True)
    lines = [
        "## `glmcheck verify` on `glm5-dims` (f32 reference, q4_k_m candidate)",
        "",
        f"{os.cpu_count()} cores on the machine; page cache warm; "
        "`--set first_k_dense_replace=1`.",
        "",
        "| layers | experts | reference GB | candidate GB | threads | build | tensors (exact) "
        "| blocks re-quantized | wall s | CPU s | candidate GB/s | read GB/s | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layers, experts, gb_r, gb_c, threads, what, s, r in rows:
        share = (f"{100 * s['blocks_requantized'] / s['blocks']:.1f}%"
                 if "blocks" in s and s["blocks"] else "all")
        lines.append(
            f"| {layers} | {experts} | {gb_r:.2f} | {gb_c:.2f} | {threads} | {what} "
            f"| {s['tensors']} ({s['exact']}) | {share} "
            f"| {r['wall']:.1f} | {r['cpu']:.1f} | {gb_c / r['wall']:.3f} "
            f"| {(gb_r + gb_c) / r['wall']:.2f} | {r['rss']:.0f} |")
    text = "\n".join(lines) + "\n"
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "verify.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
