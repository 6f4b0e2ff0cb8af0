#!/usr/bin/env python3
"""Speed and memory of glmcheck's CPU reference executor, with transformers as the yardstick.

    .venv/bin/python benches/reference.py [--glmcheck target/release/glmcheck] [--reps 5]
                                          [--threads N] [--skip-glm5]

Why: glmcheck records every stage of a forward, so it must not cost more than the plain
transformers forward people would otherwise run, and it streams weights layer by layer, so its
peak memory must not grow with the depth of a model. This bench checks both in one run:

* `small` (HF safetensors and an f32 GGUF), one 64-token prompt: `glmcheck run` (every stage with
  statistics, logits and layer outputs in full) against transformers' float32 forward, plain and
  through the recording probe, all on the same N threads (N = this machine's cores).
* `glm5-dims --fast --quant q4_k_m` with 2 and with 6 layers, 8 tokens: time and peak RSS of
  `glmcheck run` (each file is written, measured and deleted in turn: they are several GB);
* `glmcheck bisect` at TP 8 on `glm5-dims` with one dense and one MoE layer: clean, bf16 and
  planted faults, time and peak RSS.
* Later passes (`--generate 8`) on `glm5-dims` with one dense and one MoE layer of 32 experts:
  `run` in f32 and bf16 and `bisect` at TP 8, each with the weights kept between passes (the
  default) and without (`GLMCHECK_KEEP_WEIGHTS_GIB=0`); the bf16 run against the f32 run is the
  emulated envelope's cost (`--passes-only` runs just this part).

Peak RSS is per child process (os.wait4). The Markdown table goes to bench-results/reference.md
and to stdout. It builds nothing: `just bench` runs `cargo build --release` first.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [(i * 37 + 11) % 8000 for i in range(64)]  # 64 fixed ids below small's vocab (8192)
GLM5_PROMPT = list(range(100, 108))
GLM5_LAYERS = (2, 6)


def measure(cmd: list, env: dict, answers: tuple = (0,)) -> dict:
    """Run `cmd` to completion: wall and CPU seconds, peak RSS (MiB) and stdout. Its stderr
    (transformers' load reports) is shown only if it fails: exits with a code not among
    `answers` (bisect's 1 is an answer: a fault found)."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        with proc.stdout:
            out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if proc.returncode not in answers:
            err.seek(0)
            raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{err.read()}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss / 1024,
            "stdout": out}


def repeat(cmd_for, env: dict, reps: int) -> dict:
    """`reps` runs of `cmd_for(i)`: best and median wall seconds, least CPU seconds, the
    largest peak RSS."""
    runs = [measure(cmd_for(i), env) for i in range(reps)]
    walls = [r["wall"] for r in runs]
    return {"best": min(walls), "median": statistics.median(walls),
            "cpu": min(r["cpu"] for r in runs), "rss": max(r["rss"] for r in runs)}


def thread_env(n: int) -> dict:
    """The environment pinning rayon (glmcheck) and OpenMP/MKL (torch) to `n` threads."""
    env = dict(os.environ)
    for var in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(n)
    return env


def synth(glmcheck: str, out: Path, *args: str) -> None:
    cmd = [glmcheck, "synth", *args, "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def ids(tokens: list) -> str:
    return ",".join(map(str, tokens))


def glmcheck_run(glmcheck: str, model: Path, tokens: list, trace: Path) -> list:
    """`glmcheck run` with its defaults: every stage's statistics, logits and `L*.out` in full."""
    return [glmcheck, "run", str(model), "--tokens", ids(tokens), "--out", str(trace)]


# ---- the transformers side, run as `reference.py worker ...` in a child process ----

def worker(model_dir: str, threads: int, reps: int, record: bool, trace_dir: str) -> None:
    """Load `model_dir`, forward the prompt once, then `reps` timed warm forwards (recording the
    stages through the probe's hooks when `record`); prints the timings as JSON."""
    import torch
    import transformers
    from transformers import GlmMoeDsaForCausalLM

    torch.set_num_threads(threads)
    model = GlmMoeDsaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPT])
    times, cpu = [], []
    for i in range(reps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        if record:
            record_forward(model, model_dir, prompt, Path(trace_dir) / f"warm{i}.trace")
        else:
            with torch.no_grad():
                model(prompt, use_cache=False)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    # The decoder layers alone (and the final norm), fed the embedded prompt: what glmcheck's
    # layer seconds time.
    layers = []
    with torch.no_grad():
        embedded = model.model.embed_tokens(prompt)
        for _ in range(reps if not record else 0):
            start = time.perf_counter()
            model.model(inputs_embeds=embedded, use_cache=False)
            layers.append(time.perf_counter() - start)
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(json.dumps({"warm": times[1:], "cpu": cpu[1:], "layers": layers, "versions": versions}))


def record_forward(model, model_dir: str, prompt, out: Path) -> None:
    """One forward through the probe's hooks, writing its trace: the probe's `probe()` without
    loading the model."""
    import torch
    from glmcheck_probe import transformers_probe as tp
    from glmcheck_probe.trace import DEFAULT_FULL, TraceWriter

    tokens = prompt[0].tolist()
    writer = TraceWriter(str(out), tp.header(model_dir, tokens), DEFAULT_FULL)
    rec = tp.Recorder(writer, len(tokens), model.config.num_attention_heads)
    hooks = tp._hooks(rec, model)
    try:
        with torch.no_grad(), tp._recording_rope(rec):
            model(prompt, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    writer.finish()


def worker_cmd(model: Path, threads: int, reps: int, record: bool, tmp: Path) -> list:
    return [sys.executable, __file__, "worker", str(model), str(threads), str(reps),
            str(int(record)), str(tmp)]


def transformers_warm(env: dict, model: Path, threads: int, reps: int, record: bool,
                      tmp: Path) -> dict:
    """Warm forward seconds of transformers (best and median wall, least CPU, of `reps` after
    one warm-up), the worker's peak RSS and the versions it ran."""
    run = measure(worker_cmd(model, threads, reps, record, tmp), env)
    times = json.loads(run["stdout"].strip().splitlines()[-1])
    warm, layers = times["warm"], times["layers"]
    return {"best": min(warm), "median": statistics.median(warm), "cpu": min(times["cpu"]),
            "rss": run["rss"], "versions": times["versions"],
            "layers": {"best": min(layers), "median": statistics.median(layers),
                       "cpu": float("nan"), "rss": run["rss"]} if layers else None}


def glmcheck_warm(glmcheck: str, model: Path, env: dict, reps: int, tmp: Path) -> dict:
    """The recorded forward after one unrecorded warm-up pass, by the trace's layer seconds (the
    decoder layers with every stage's statistics; not the embedding and the head)."""
    layers, rss = [], 0.0
    for i in range(reps):
        trace = tmp / f"glmcheck-warm{i}.trace"
        run = measure([*glmcheck_run(glmcheck, model, PROMPT, trace), "--warm-up", "1"], env)
        seconds = json.loads((trace / "manifest.json").read_text())["producer"]["layer_seconds"]
        layers.append(sum(v for k, v in seconds.items() if "." not in k))
        rss = max(rss, run["rss"])
    return {"best": min(layers), "median": statistics.median(layers), "cpu": float("nan"),
            "rss": rss}


# ---- the two benchmarks ----

def bench_small(glmcheck: str, tmp: Path, threads: int, reps: int, py_reps: int) -> tuple:
    """Rows (contender, what is timed, timing) for the 64-token prompt on `small`, and the
    torch/transformers versions."""
    print("small: glmcheck and transformers…", file=sys.stderr)
    env = thread_env(threads)
    hf, gguf = tmp / "small_hf", tmp / "small.gguf"
    synth(glmcheck, hf, "--preset", "small", "--format", "hf")
    synth(glmcheck, gguf, "--preset", "small", "--quant", "f32")
    def glm(model):
        return lambda i: glmcheck_run(glmcheck, model, PROMPT, tmp / f"{model.name}{i}.trace")

    def probe_cli(i):
        return [sys.executable, "-m", "glmcheck_probe.transformers_probe", str(hf),
                "--tokens", ids(PROMPT), "--out", str(tmp / f"probe{i}.trace")]

    process = "process: load, forward, trace of every stage"
    rows = [
        ("glmcheck run, HF folder", process, repeat(glm(hf), env, reps)),
        ("glmcheck run, GGUF f32", process, repeat(glm(gguf), env, reps)),
    ]
    plain = transformers_warm(env, hf, threads, reps, False, tmp)
    plain_process = repeat(lambda _: worker_cmd(hf, threads, 0, False, tmp), env, py_reps)
    recording = transformers_warm(env, hf, threads, reps, True, tmp)
    rows += [
        ("glmcheck run --warm-up 1, GGUF f32", "warm forward: the layers (trace's layer seconds)",
         glmcheck_warm(glmcheck, gguf, env, reps, tmp)),
        ("transformers", "warm forward only (in process)", plain),
        ("transformers", "warm forward: the layers (in process)", plain["layers"]),
        ("transformers", "process: import, load, one forward", plain_process),
        ("transformers + glmcheck_probe", "warm forward recording every stage", recording),
        ("transformers + glmcheck_probe", "process: the probe CLI",
         repeat(probe_cli, env, py_reps)),
    ]
    return rows, plain["versions"]


def bench_glm5(glmcheck: str, tmp: Path, threads: int) -> list:
    """(layers, file GiB, one run of `glmcheck run` on 8 tokens) for each of GLM5_LAYERS; every
    file is deleted right after its run."""
    rows = []
    for layers in GLM5_LAYERS:
        print(f"glm5-dims, {layers} layers…", file=sys.stderr)
        model = tmp / f"glm5-{layers}.gguf"
        synth(glmcheck, model, "--preset", "glm5-dims", "--layers", str(layers), "--fast",
              "--quant", "q4_k_m")
        size = model.stat().st_size / 2**30
        trace = tmp / f"glm5-{layers}.trace"
        try:
            run = measure(glmcheck_run(glmcheck, model, GLM5_PROMPT, trace), thread_env(threads))
        finally:
            model.unlink()
        rows.append((layers, size, run))
    return rows


BISECT_CASES = [
    ("clean, f32", []),
    ("clean, bf16", ["--dtype", "bf16"]),
    ("unsharded-column", ["--inject", "unsharded-column"]),
    ("dequant-q4k-scales", ["--inject", "dequant-q4k-scales"]),
    ("dequant-q4k-scales, --mode logits", ["--inject", "dequant-q4k-scales", "--mode", "logits"]),
]


def bench_bisect(glmcheck: str, tmp: Path, threads: int) -> list:
    """(case, verdict, first divergence, class, one `glmcheck bisect` at TP 8) on glm5-dims with
    one dense and one MoE layer (256 experts), q4_k_m; the file is deleted after."""
    print("glm5-dims bisect, TP 8…", file=sys.stderr)
    model = tmp / "glm5-bisect.gguf"
    synth(glmcheck, model, "--preset", "glm5-dims", "--layers", "2", "--set",
          "first_k_dense_replace=1", "--fast", "--quant", "q4_k_m")
    rows = []
    try:
        for name, extra in BISECT_CASES:
            cmd = [glmcheck, "bisect", str(model), "--tp", "8", "--tokens", ids(GLM5_PROMPT),
                   "--generate", "0", "--json", *extra]
            run = measure(cmd, thread_env(threads), answers=(0, 1))
            j = json.loads(run["stdout"])
            first = (j["first_divergence"] or {}).get("stage", "-")
            rows.append((name, j["verdict"], first, (j["fault"] or {}).get("class", "-"), run))
    finally:
        model.unlink()
    return rows


def bench_passes(glmcheck: str, tmp: Path, threads: int) -> list:
    """(command, dtype, kept?, measure) for a prompt and 8 generated tokens on glm5-dims with
    one dense and one MoE layer of 32 experts, q4_k_m; the file is deleted after."""
    print("glm5-dims, later passes…", file=sys.stderr)
    model = tmp / "glm5-passes.gguf"
    synth(glmcheck, model, "--preset", "glm5-dims", "--layers", "2", "--experts", "32", "--set",
          "first_k_dense_replace=1", "--fast", "--quant", "q4_k_m")
    rows = []
    try:
        for command, dtype in (("run", "f32"), ("run", "bf16"), ("bisect", "f32"),
                               ("bisect", "bf16")):
            for kept in (False, True):
                out = tmp / f"{command}-{dtype}-{kept}"
                args = (["run", str(model), "--out", f"{out}.trace"] if command == "run"
                        else ["bisect", str(model), "--tp", "8", "--out", str(out)])
                cmd = [glmcheck, *args, "--tokens", ids(GLM5_PROMPT), "--generate", "8",
                       "--dtype", dtype, "--json"]
                env = {**thread_env(threads), **({} if kept else {"GLMCHECK_KEEP_WEIGHTS_GIB": "0"})}
                rows.append((command, dtype, kept, measure(cmd, env, answers=(0, 1))))
    finally:
        model.unlink()
    return rows


# ---- the report ----

def markdown_table(headers: list, rows: list) -> str:
    """A Markdown table with padded columns, as bench-results/dequant.md has them."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *map(line, rows)])


def proc_field(path: str, key: str) -> str:
    """The value after `key` in a `key: value` file of /proc."""
    with open(path) as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith(key))


def machine(threads: int) -> str:
    """CPU, cores, memory and load: what the numbers depend on."""
    mem_gib = int(proc_field("/proc/meminfo", "MemTotal").split()[0]) / 2**20
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    return (f"{proc_field('/proc/cpuinfo', 'model name')}, {os.cpu_count()} cores, "
            f"{mem_gib:.0f} GiB RAM, load average {load} at the end (other work on the machine "
            f"shows up as noise); every contender on {threads} threads")


def report(threads: int, reps: int, py_reps: int, small: list, versions: str,
           glm5: list, bisect: list, passes: list) -> str:
    """The Markdown of bench-results/reference.md."""
    parts = ["# Reference executor", f"Machine: {machine(threads)}." + (f" {versions}." if versions else "")]
    if small:
        parts += small_report(reps, py_reps, small)
    parts += glm5_report(glm5, bisect)
    if passes:
        f32_run = {kept: r["wall"] for c, d, kept, r in passes if (c, d) == ("run", "f32")}
        rows = [(c, d, "kept" if kept else "not kept", f"{r['wall']:.2f}", f"{r['cpu']:.2f}",
                 f"{r['rss']:.0f}", f"{r['wall'] / f32_run[kept]:.2f}×" if c == "run" else "")
                for c, d, kept, r in passes]
        parts += [
            "## Later passes: 8 generated tokens on `glm5-dims`, one dense and one MoE layer of "
            "32 experts, `--fast --quant q4_k_m`",
            "One process per row. `run` at TP 1; `bisect` at TP 8 (reference, envelope where "
            "bf16, candidate), each generating 8 tokens after the 8-token prompt. \"kept\": the "
            "default, weights held once and kept for the later passes within the budget; \"not "
            "kept\": `GLMCHECK_KEEP_WEIGHTS_GIB=0`, every pass dequantizes again. Aim: the bf16 "
            "run within 1.5× of the f32 run.",
            markdown_table(["command", "dtype", "weights", "wall s", "CPU s", "peak RSS MiB",
                            "run / f32 run"], rows),
        ]
    return "\n\n".join(parts) + "\n"


def small_report(reps: int, py_reps: int, small: list) -> list:
    base = small[0][2]["best"]
    small_rows = [(who, what, f"{t['best']:.3f}", f"{t['median']:.3f}",
                   "-" if t["cpu"] != t["cpu"] else f"{t['cpu']:.3f}",
                   f"{t['rss']:.0f}", f"{t['best'] / base:.2f}×") for who, what, t in small]
    return [
        "## `small`, one 64-token prompt (float32)",
        f"Wall seconds, best and median of {reps} runs ({py_reps} for the transformers processes; "
        "the warm rows after one untimed forward); CPU seconds (user + system, all threads) of "
        "the cheapest run. glmcheck records every stage's statistics and stores the "
        "logits and layer outputs in full (its defaults), as the probe does. Aim: glmcheck's "
        "whole process no slower than transformers' forward.",
        markdown_table(["contender", "timed", "best s", "median s", "CPU s", "peak RSS MiB",
                        "best / glmcheck HF"], small_rows),
    ]


def glm5_report(glm5: list, bisect: list) -> list:
    parts = []
    if glm5:
        rss2 = glm5[0][2]["rss"]
        glm5_rows = [(n, f"{gib:.2f}", len(GLM5_PROMPT), f"{r['wall']:.2f}", f"{r['cpu']:.2f}",
                      f"{r['rss']:.0f}", f"{r['rss'] / rss2:.3f}") for n, gib, r in glm5]
        parts += [
            "## `glm5-dims --fast --quant q4_k_m`, 8 tokens",
            "One `glmcheck run` per depth, wall and CPU seconds of the process (the file was just "
            "written: it is read from the page cache as far as it fits in RAM). Aim: peak RSS "
            "within 10% across depths.",
            markdown_table(["layers", "file GiB", "tokens", "run s", "CPU s", "peak RSS MiB",
                            "RSS / 2 layers"], glm5_rows),
        ]
    if bisect:
        bisect_rows = [(name, verdict, first, cls, f"{r['wall']:.2f}", f"{r['cpu']:.2f}",
                        f"{r['rss']:.0f}") for name, verdict, first, cls, r in bisect]
        parts += [
            "## `glmcheck bisect` at TP 8, `glm5-dims` with one dense and one MoE layer "
            "(256 experts), `--fast --quant q4_k_m`, 8 tokens",
            "One run per case: the reference (TP 1, f32), the envelope where the candidate is "
            "bf16, the candidate (8 ranks on the CPU), the comparison, the replay and the "
            "drill-down into weights and shards. Aim: peak RSS near one run's.",
            markdown_table(["case", "verdict", "first divergence", "class", "wall s", "CPU s",
                            "peak RSS MiB"], bisect_rows),
        ]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--glmcheck", default=str(ROOT / "target" / "release" / "glmcheck"))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--reps", type=int, default=5,
                        help="timed runs of glmcheck and warm forwards")
    parser.add_argument("--py-reps", type=int, default=3, help="timed transformers processes")
    parser.add_argument("--skip-glm5", action="store_true",
                        help="leave out the multi-GB glm5-dims runs (and bisect on them)")
    parser.add_argument("--passes-only", action="store_true",
                        help="only the later-passes table (kept weights, the bf16 envelope)")
    args = parser.parse_args()
    print(f"reference bench on {args.threads} threads", file=sys.stderr)
    small, versions, glm5, bisect, passes = [], "", [], [], []
    with tempfile.TemporaryDirectory(prefix="glmcheck-bench-") as tmp:
        if not args.passes_only:
            small, versions = bench_small(args.glmcheck, Path(tmp), args.threads, args.reps,
                                          args.py_reps)
        if not (args.skip_glm5 or args.passes_only):
            glm5 = bench_glm5(args.glmcheck, Path(tmp), args.threads)
            bisect = bench_bisect(args.glmcheck, Path(tmp), args.threads)
        if not args.skip_glm5:
            passes = bench_passes(args.glmcheck, Path(tmp), args.threads)
    text = report(args.threads, args.reps, args.py_reps, small, versions, glm5, bisect, passes)
    out = ROOT / "bench-results" / "reference.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        model_dir, threads, reps, record, tmp = sys.argv[2:7]
        worker(model_dir, int(threads), int(reps), record == "1", tmp)
    else:
        main()
