#!/usr/bin/env python3
"""What `glmcheck endpoint --explain` costs on GLM-5's real widths, and on paper for GLM-5.

    .venv/bin/python benches/explain.py [--glmcheck target/release/glmcheck] [--tokens 8]
                                        [--budget 4] [--tp8-budget 2] [--threads N]
                                        [--reps 2] [--experts 256] [--real-weights]
                                        [--out FILE]

Why: `--explain` runs one full reference forward per hypothesis (clean and every catalogued
fault that can exist at the server's TP), so its cost is the number of hypotheses times one
forward. On a 744B model that decides whether it is a step to take before anything else or a
job for the night.

The bench:

1. `glmcheck synth --preset glm5-dims --layers 2 --set first_k_dense_replace=1 --fast --quant
   q4_k_m`: one dense and one MoE layer of 256 experts at GLM-5's real widths, written in about
   20 s to a temporary folder and deleted at the end. `--fast` writes random valid blocks: the
   forward's work is the same as with real weights (same shapes, 8 experts a token), but the
   logits reach about 1e7, so every hypothesis that does not reproduce the server exactly sits
   near the 30-nat cap; the fit is only a check that the planted fault comes first.
   `--real-weights` quantizes generated weights instead (scores as a real model gives them;
   half of the 256-expert file took 10 minutes on a loaded 2-core host, and `--experts 32`
   11 minutes in all).
2. The faulty server's logits: `glmcheck run MODEL --tp 2 --inject unsharded-column=kv_b` on the
   prompt (vLLM's ColumnParallel loader giving every rank rank 0's rows of `kv_b_proj`), read
   from its trace with numpy. Its `producer.layer_seconds` give the dense and the MoE layer's
   seconds at TP 2 for the projection.
3. A local HTTP server in a thread answers `GET /v1/models` and `POST /v1/completions` in vLLM
   0.32's shape (`prompt_logprobs` keyed by id with logprob, rank and `decoded_token: null`; the
   generated token's `top_logprobs` keyed `token_id:ID`; `prompt_token_ids`, `token_ids`, as a
   server started with `--skip-tokenizer-init` gives them) from those logits.
4. `glmcheck endpoint URL MODEL --tokens … --max-tokens 1 --explain --tp 2 --json`: every
   hypothesis; again with `--budget N`; and at `--tp 8` with a small budget (the number of
   hypotheses a TP 8 server gets, and one TP 8 hypothesis' seconds); the full run twice
   (`--reps`), each hypothesis' least seconds kept, as the host is shared. Each hypothesis' seconds
   and the total from the JSON (`explanation.ranking[].seconds`, `explanation.seconds`), wall
   and peak RSS of each process (os.wait4). The bench fails unless `unsharded-column=kv_b`
   ranks first with the verdict `explained` at TP 2.

The full model on paper: a hypothesis is one forward, so its seconds are `rest + layers`, where
the layers are measured in step 2's trace and `rest` (the head over 154880 rows, embedding,
trace writing, the fit) is the median hypothesis less those layers; GLM-5 has the same
vocabulary and widths, 3 dense and 75 MoE layers: `rest + 3·dense + 75·MoE` a hypothesis, plus
reading its 402 GB of q4_k_m once per hypothesis where the page cache cannot hold the file.

Writes bench-results/explain.md (or --out) and prints it.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
PLANTED = "unsharded-column=kv_b"
FULL_DENSE, FULL_MOE, FULL_BYTES = 3, 75, 402e9
DISKS = (3.0, 7.0)  # GB/s: one NVMe drive, a striped pair


def run(cmd: list, env: dict, answers: tuple = (0,)) -> dict:
    """`cmd` to completion: wall seconds, peak RSS (GiB), exit code, stdout; fails loudly on an
    exit code not among `answers`."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
        with proc.stdout:
            out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # releases the GIL: the server thread answers
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        proc.returncode = code
        if code not in answers:
            err.seek(0)
            raise SystemExit(f"exit {code}: {' '.join(map(str, cmd))}\n{err.read()}")
    return {"wall": wall, "rss_gib": usage.ru_maxrss / 2**20, "code": code, "out": out}


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def trace_logits(trace: Path) -> np.ndarray:
    """The whole logits `[positions, vocab]` of a glmcheck trace (the gathered stage, not a
    rank's shard)."""
    manifest = json.loads((trace / "manifest.json").read_text())
    for s in manifest["stages"]:
        if s["name"] == "logits" and s.get("rank") is None and "file" in s:
            return load_file(str(trace / s["file"]))[s["tensor"]]
    raise SystemExit(f"{trace}: no whole logits stage")


# ---- the faulty server, answering as vLLM 0.32 does ----

def log_softmax(row: np.ndarray) -> np.ndarray:
    """vLLM's log-probabilities: log_softmax in float32."""
    row = row.astype(np.float32)
    m = row.max()
    return row - (m + np.log(np.exp(row - m).sum(dtype=np.float32)))


def entries(lp: np.ndarray, k: int, own: int = None) -> list:
    """(id, logprob, rank) of the `own` token (whatever its rank) and the top `k`, vLLM's order:
    the sampled or prompt token first."""
    top = np.argpartition(-lp, k)[:k]
    top = top[np.argsort(-lp[top], kind="stable")]
    out = []
    if own is not None:
        out.append((own, float(lp[own]), int((lp > lp[own]).sum()) + 1))
    out += [(int(t), float(lp[t]), r + 1) for r, t in enumerate(top) if t != own]
    return out


def completion(logits: np.ndarray, tokens: list, k: int, model: str) -> dict:
    """vLLM 0.32's `/v1/completions` answer for `tokens` (`prompt_logprobs: k`, `logprobs: k`,
    `return_tokens_as_token_ids`, `return_token_ids`, one generated token, no tokenizer)."""
    lps = [log_softmax(r) for r in logits]
    prompt = [None] + [
        {str(t): {"logprob": lp, "rank": rank, "decoded_token": None}
         for t, lp, rank in entries(lps[i - 1], k, tokens[i])}
        for i in range(1, len(tokens))
    ]
    last = lps[-1]
    chosen = int(last.argmax())
    top = entries(last, k, chosen)
    return {
        "id": "cmpl-bench", "object": "text_completion", "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0, "text": "",
            "logprobs": {"text_offset": [0], "token_logprobs": [top[0][1]],
                         "tokens": [f"token_id:{chosen}"],
                         "top_logprobs": [{f"token_id:{t}": lp for t, lp, _ in top}]},
            "finish_reason": "length", "stop_reason": None, "token_ids": [chosen],
            "prompt_logprobs": prompt, "prompt_token_ids": tokens, "routed_experts": None,
        }],
        "service_tier": None, "system_fingerprint": "vllm-0.32.0",
        "usage": {"prompt_tokens": len(tokens), "total_tokens": len(tokens) + 1,
                  "completion_tokens": 1, "prompt_tokens_details": None,
                  "completion_tokens_details": None},
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


def serve(logits: np.ndarray, tokens: list, model: str) -> tuple:
    """A server on a free local port answering as vLLM 0.32 serving `model` with these logits;
    (URL, the server)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                self.reply(200, {"object": "list", "data": [{
                    "id": model, "object": "model", "created": int(time.time()),
                    "owned_by": "vllm", "root": model, "parent": None,
                    "max_model_len": 4096, "permission": []}]})
            else:
                self.reply(404, {"error": {"message": "Not Found"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions":
                self.reply(404, {"error": {"message": "Not Found"}})
            elif body.get("prompt") != tokens or body.get("max_tokens") != 1:
                self.reply(400, {"error": {"message": "the bench serves one prompt, one token"}})
            else:
                self.reply(200, completion(logits, tokens, int(body["prompt_logprobs"]), model))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


# ---- the bench ----

def explain(g: str, url: str, model: Path, tokens: str, env: dict, tp: int,
            budget: int = None) -> dict:
    cmd = [g, "endpoint", url, model, "--tokens", tokens, "--max-tokens", "1", "--explain",
           "--tp", tp, "--json"] + (["--budget", budget] if budget else [])
    r = run(cmd, env, answers=(1,))  # 1: the server parts from the reference
    report = json.loads(r["out"])
    e = report["explanation"]
    past = [n for n in e["not_tried"] if "past --budget" in n]
    left = int(past[0].split()[0]) if past else 0
    secs = [h["seconds"] for h in e["ranking"]]
    clean = next(h["seconds"] for h in e["ranking"] if h["name"] == "clean")
    faults = [h["seconds"] for h in e["ranking"] if h["name"] != "clean"]
    return {"tp": tp, "budget": budget, "runs": len(secs), "left": left, "wall": r["wall"],
            "rss_gib": r["rss_gib"], "seconds": e["seconds"], "clean_s": clean,
            "min": min(faults), "median": statistics.median(faults), "max": max(faults),
            "verdict": e["verdict"], "best": e["best"]["name"], "best_score": e["best"]["score"],
            "clean_score": e["clean_score"], "runner_up": e["runner_up"]["name"],
            "runner_up_score": e["runner_up"]["score"], "failed": e["failed"],
            "ranking": e["ranking"],
            "reference_s": sum(p["reference_seconds"] for p in report["prompts"])}


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")


def best_of(reps: list) -> dict:
    """Several runs of one explain as one: each hypothesis' least seconds, the least total and
    wall, the largest peak RSS (the host is shared: a slow spell falls on one run)."""
    if len(reps) == 1:
        return reps[0]
    first = reps[0]
    for r in reps[1:]:
        if (r["best"], r["verdict"]) != (first["best"], first["verdict"]):
            raise SystemExit(f"FAIL: runs disagree: {r['best']} {r['verdict']} against "
                             f"{first['best']} {first['verdict']}")
    least = {h["name"]: min(x["seconds"] for r in reps for x in r["ranking"]
                            if x["name"] == h["name"]) for h in first["ranking"]}
    ranking = [{**h, "seconds": least[h["name"]]} for h in first["ranking"]]
    faults = [h["seconds"] for h in ranking if h["name"] != "clean"]
    return {**first, "ranking": ranking, "clean_s": least["clean"], "min": min(faults),
            "median": statistics.median(faults), "max": max(faults),
            "seconds": min(r["seconds"] for r in reps), "wall": min(r["wall"] for r in reps),
            "rss_gib": max(r["rss_gib"] for r in reps), "reps": len(reps)}


def table(headers: list, rows: list) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--glmcheck", default=str(ROOT / "target/release/glmcheck"))
    ap.add_argument("--tokens", type=int, default=8, help="prompt length")
    ap.add_argument("--budget", type=int, default=4, help="the --budget run at TP 2")
    ap.add_argument("--tp8-budget", type=int, default=2, help="the --budget run at TP 8 (0: none)")
    ap.add_argument("--experts", type=int, default=256, help="routed experts (GLM-5: 256)")
    ap.add_argument("--real-weights", action="store_true",
                    help="quantize generated weights instead of --fast's random blocks (slow: "
                         "11 minutes for --experts 32 on 2 loaded cores)")
    ap.add_argument("--reps", type=int, default=2,
                    help="runs of the full --explain --tp 2 (each hypothesis' least seconds)")
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "explain.md"))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    args.load_start = os.getloadavg()[0]
    g = args.glmcheck
    env = {**os.environ, "RAYON_NUM_THREADS": str(args.threads)}
    ids = [(i * 37 + 11) % 383 for i in range(args.tokens)]
    tokens = ",".join(map(str, ids))
    with tempfile.TemporaryDirectory(prefix="glmcheck-explain-") as tmp:
        tmp = Path(tmp)
        model = tmp / "glm5-dims-2.gguf"
        print("synth glm5-dims, 2 layers, q4_k_m…", file=sys.stderr, flush=True)
        synth = run([g, "synth", "--preset", "glm5-dims", "--layers", 2, "--set",
                     "first_k_dense_replace=1", "--experts", args.experts, "--quant", "q4_k_m",
                     "--out", model] + ([] if args.real_weights else ["--fast"]), env)
        gib = model.stat().st_size / 2**30
        warm(model)
        print(f"the server's logits: run --tp 2 --inject {PLANTED}…", file=sys.stderr, flush=True)
        layer_s = {}
        for i in range(3):  # each layer's least seconds of 3 runs: the host is shared
            out = tmp / f"server{i}.trace"
            served = run([g, "run", model, "--tokens", tokens, "--tp", 2, "--inject", PLANTED,
                          "--latent-norm-eps", "1e-5", "--out", out], env)
            seconds = json.loads((out / "manifest.json").read_text())["producer"]["layer_seconds"]
            layer_s = {k: min(v, layer_s.get(k, v)) for k, v in seconds.items()}
        logits = trace_logits(out)
        url, server = serve(logits, ids, str(model))
        try:
            print("endpoint without --explain…", file=sys.stderr, flush=True)
            check = run([g, "endpoint", url, model, "--tokens", tokens, "--max-tokens", "1",
                         "--json"], env, answers=(1,))
            check["reference_s"] = json.loads(check["out"])["prompts"][0]["reference_seconds"]
            results = []
            for tp, budget in [(2, None), (2, args.budget), (8, args.tp8_budget)]:
                if budget == 0:
                    continue
                print(f"endpoint --explain --tp {tp}" + (f" --budget {budget}" if budget else "")
                      + "…", file=sys.stderr, flush=True)
                reps = [explain(g, url, model, tokens, env, tp, budget)
                        for _ in range(args.reps if budget is None else 1)]
                results.append(best_of(reps))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "ranking"}),
                      file=sys.stderr, flush=True)
        finally:
            server.shutdown()
    full = results[0]
    if full["best"] != PLANTED or full["verdict"] != "explained":
        raise SystemExit(f"FAIL: --explain --tp 2 names {full['best']} ({full['verdict']}), "
                         f"not the planted {PLANTED}:\n{json.dumps(full['ranking'], indent=1)}")
    if full["failed"]:
        raise SystemExit(f"FAIL: hypotheses that could not run: {full['failed']}")
    for r in results[1:]:
        if r["tp"] == 2 and r["best"] != PLANTED:
            raise SystemExit(f"FAIL: --budget {r['budget']} names {r['best']}")
    text = report(args, gib, synth, served, layer_s, check, results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


def report(args, gib: float, synth: dict, served: dict, layer_s: dict, check: dict,
           results: list) -> str:
    full = results[0]
    dense, moe = layer_s["L0"], layer_s["L1"]
    rest = full["median"] - dense - moe
    scale = (FULL_DENSE * dense + FULL_MOE * moe) / (dense + moe)
    per_hyp = rest + FULL_DENSE * dense + FULL_MOE * moe  # the median hypothesis

    def full_model(h: float) -> float:
        """A hypothesis' seconds on GLM-5: the shared rest, its layers scaled by `scale`."""
        return rest + (h - rest) * scale

    n = full["runs"]
    all_full = sum(full_model(h["seconds"]) for h in full["ranking"])
    order = [h["name"] for h in sorted(full["ranking"], key=lambda h: h["seconds"])]
    # The budget's hypotheses at their seconds in the full run (one measurement, less noise).
    seconds = {h["name"]: h["seconds"] for h in full["ranking"]}
    budget_full = sum(full_model(seconds[h["name"]]) for h in results[1]["ranking"])
    weights = "random valid blocks (`--fast`)" if not args.real_weights else "quantized generated weights"
    model = f"glm5-dims, 1 dense + 1 MoE layer of {args.experts} experts, q4_k_m"
    rows = [[model, 2, args.tokens, "-", "-", "0 (no --explain)", "-", "-", "-",
             f"{check['wall']:.1f}", f"{check['rss_gib']:.2f}",
             f"reference {check['reference_s']:.2f} s"]]
    for r in results:
        runs = f"{r['runs']}" + (f" of {r['runs'] + r['left']}" if r["left"] else "")
        runs += f" (best of {r['reps']} runs each)" if r.get("reps", 1) > 1 else ""
        verdict = (f"{r['best']} {r['best_score']:.2e} (clean {r['clean_score']:.3f}, "
                   f"{r['runner_up']} {r['runner_up_score']:.3f}): {r['verdict']}"
                   if r["tp"] == 2 else "- (the server is TP 2: count and time only)")
        rows.append([
            model, 2, args.tokens, r["tp"], r["budget"] or "-", runs, f"{r['clean_s']:.2f}",
            f"{r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}", f"{r['seconds']:.1f}",
            f"{r['wall']:.1f}", f"{r['rss_gib']:.2f}", verdict])
    measured = table(["model", "layers", "prompt tokens", "--tp", "--budget", "hypotheses run",
                      "clean s", "fault s min / median / max", "explain s", "endpoint wall s",
                      "peak RSS GiB", "best (score), clean, runner-up: verdict"], rows)
    slowest = sorted(full["ranking"], key=lambda h: -h["seconds"])[:3]
    proj = [["compute only", f"{per_hyp:.0f}", f"{all_full / 60:.0f}",
             f"{budget_full / 60:.1f}"]]
    for d in DISKS:
        read = FULL_BYTES / (d * 1e9)
        proj.append([f"+ 402 GB read at {d:g} GB/s", f"{per_hyp + read:.0f}",
                     f"{(all_full + n * read) / 60:.0f}",
                     f"{(budget_full + args.budget * read) / 60:.1f}"])
    parts = [
        "# endpoint --explain",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, RAYON_NUM_THREADS={args.threads}, "
        f"page cache warm; load average {args.load_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end (other work on the host shows up as noise). "
        f"Model: `glmcheck synth --preset glm5-dims --layers 2 --set first_k_dense_replace=1 "
        f"--experts {args.experts} --quant q4_k_m`, {weights} ({gib:.2f} GiB with the MTP layer, "
        f"written in {synth['wall']:.0f} s). Server: a local "
        f"HTTP server answering as vLLM 0.32 with the logits of `glmcheck run --tp 2 --inject "
        f"{PLANTED}` ({served['wall']:.1f} s wall, peak RSS {served['rss_gib']:.2f} GiB; its "
        f"trace's layers, least of 3 runs: dense {dense:.3f} s, MoE {moe:.3f} s at TP 2). Command: `glmcheck "
        f"endpoint URL MODEL --tokens … --max-tokens 1 --explain --tp N [--budget B] --json`; "
        f"seconds per hypothesis from `explanation.ranking[].seconds`, explain s from "
        f"`explanation.seconds`; clean runs first (it reads the weights first).",
        measured,
        "Slowest hypotheses at TP 2: " + ", ".join(f"{h['name']} {h['seconds']:.2f} s"
                                                  for h in slowest) + ".",
        f"## Full GLM-5 on paper (78 layers: 3 dense + 75 MoE, 402 GB q4_k_m), TP 2, "
        f"{args.tokens} tokens",
        f"A hypothesis is one forward: `rest + 3·dense + 75·MoE`, with dense {dense:.3f} s and "
        f"MoE {moe:.3f} s from the server run's trace (TP 2, the same prompt) and rest = the "
        f"median fault hypothesis ({full['median']:.2f} s) less those two layers = {rest:.2f} s "
        f"(the head over 154880 rows, embedding, trace, fit: the same widths in GLM-5). Each "
        f"hypothesis' own seconds less that rest are scaled by (3·dense + 75·MoE) / (dense + "
        f"MoE) = {scale:.1f} (so a slow one, e.g. dequant-q4k-scales, stays slow in "
        f"proportion), and summed over the {n} hypotheses at TP 2 (clean included) or the "
        f"{args.budget} of `--budget {args.budget}`. Without a page cache that holds the 402 GB, "
        f"each hypothesis reads the file once more: + 402 GB / disk speed a hypothesis.",
        table(["per hypothesis", "median hypothesis s", f"all {n}, minutes",
               f"--budget {args.budget}, minutes"], proj),
        "Fastest to slowest at TP 2: " + ", ".join(order) + ".",
    ]
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    main()
