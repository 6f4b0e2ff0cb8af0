#!/usr/bin/env python3
"""What bisect's weight check of an engine's file costs on GLM-5's real widths.

    python3 benches/path_check.py [--glmcheck target/release/glmcheck] [--layers 2,4]
                                  [--experts 16] [--tokens 8]

Why: an engine trace names the file it ran; where it diverges, bisect checks that file's
weights against the reference. `--weights divergent` reads only the tensors on the path back
from the first divergence (one layer's worth whatever the model's depth); `--weights all` reads
every tensor (what `auto` does up to 32 GiB). On a 402 GB model only the first is affordable, so
its cost must not grow with the layers.

For each layer count: `glmcheck synth --preset glm5-dims` writes the f32 GGUF (the reference)
and the q4_k_m GGUF of the same weights; every block scale of `blk.1.attn_k_b` is multiplied by
4 in the q4_k_m file's bytes (`glmcheck_oracle.formats.plant_gguf_fault`; two heads swapped stay
inside Q4_K_M's envelope at these widths, and a run that passes has no path to check), and
`glmcheck run` on it records the candidate trace with its default recording (most stages as
statistics; the trace names the file). Then `glmcheck bisect REF --candidate TRACE --json` with `--weights off`, `divergent`
and `all`, page cache warm: wall seconds and peak RSS of the whole bisect, and from its JSON
the weight check's own seconds, tensors and candidate bytes read, and the verdict. The
Markdown table goes to bench-results/path-check.md and to stdout.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from verify import run, warm

ROOT = Path(__file__).resolve().parent.parent


def must(cmd: list) -> dict:
    r = run([str(c) for c in cmd])
    if r["code"] != 0:
        raise SystemExit(f"exit {r['code']}: {' '.join(map(str, cmd))}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--glmcheck", default=str(ROOT / "target/release/glmcheck"))
    ap.add_argument("--layers", default="2,4")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8)
    args = ap.parse_args()
    g = args.glmcheck
    tokens = ",".join(str(1 + 37 * i % 1000) for i in range(args.tokens))
    rows = []
    for layers in [int(n) for n in args.layers.split(",")]:
        with tempfile.TemporaryDirectory(prefix="glmcheck-path-") as tmp:
            tmp = Path(tmp)
            ref, clean = tmp / "ref.gguf", tmp / "clean.gguf"
            cand, trace = tmp / "cand.gguf", tmp / "cand.trace"
            base = [g, "synth", "--preset", "glm5-dims", "--layers", layers, "--experts",
                    args.experts, "--set", "first_k_dense_replace=1"]
            must(base + ["--quant", "f32", "--out", ref])
            must(base + ["--quant", "q4_k_m", "--out", clean])
            must([sys.executable, "-m", "glmcheck_oracle.formats.plant_gguf_fault", clean, cand,
                  "scale", "blk.1.attn_k_b.weight", "4"])
            clean.unlink()
            must([g, "run", cand, "--tokens", tokens, "--out", trace])
            warm(ref, cand)
            for mode in ("off", "divergent", "all"):
                r = run([str(c) for c in (g, "bisect", ref, "--candidate", trace, "--weights",
                                          mode, "--json")])
                if r["code"] not in (0, 1):
                    raise SystemExit(f"bisect --weights {mode}: exit {r['code']}")
                j = json.loads(r["out"])
                w = j["bisect"].get("weights") or {}
                f = j.get("fault") or {}
                rows.append([
                    layers, f"{ref.stat().st_size / 1e9:.2f}", f"{cand.stat().st_size / 1e9:.2f}",
                    mode, w.get("tensors", 0), f"{w.get('bytes_read', 0) / 2**20:.1f}",
                    f"{w.get('seconds', 0):.2f}", f"{r['wall']:.1f}", f"{r['rss']:.0f}",
                    f"{(j.get('first_divergence') or {}).get('stage', '-')} "
                    f"{f.get('class', j['verdict'])}",
                ])
                print(rows[-1], flush=True)
    head = ["layers", "reference GB", "candidate GB", "--weights", "tensors checked",
            "candidate MiB read", "check s", "bisect wall s", "peak RSS MiB", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    table = "\n".join(lines)
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    (out / "path-check.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
