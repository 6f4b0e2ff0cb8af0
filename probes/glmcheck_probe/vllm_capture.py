"""Capture one forward of a model served by vLLM, as vLLM runs it, for `glmcheck bisect`:

    python -m glmcheck_probe.vllm_capture MODEL --tp N (--tokens 1,2,3 | --prompt TEXT) \\
        --out DIR [any `vllm serve` engine argument ...]

starts vLLM through its public `LLM` class (engine arguments parsed by vLLM's own parser, so
they are spelled as for `vllm serve`), installs the probe in every tensor-parallel worker
(`vllm_worker.ProbeWorker`, through `collective_rpc`), runs the prompt once (one generated
token, with prompt log-probabilities so that vLLM computes logits at every position), and writes

    DIR/run.trace     the ranks' traces merged (`glmcheck bisect MODEL --candidate DIR/run.trace`)
    DIR/shards.json   the ranks' shard manifests merged (`--actual DIR/shards.json`)
    DIR/ranks/        the per-rank files they were merged from

A GGUF is served through `vllm-gguf-plugin` (GGUF left vLLM's tree after 0.23), given with the
folder of its Hugging Face config: `vllm_capture model.gguf --hf-config-path DIR --tokenizer DIR
…`; on a CPU glmcheck's plugin stands in for the GGUF plugin's kernels (`gguf_kernels`).

`--shards-only` loads the model and writes `DIR/shards.json` without running a prompt
(`glmcheck shards MODEL --actual DIR/shards.json` checks it): how vLLM cut the weights, even
where the forward cannot run.

The forward runs eagerly (`enforce_eager`), for hooks do not see inside CUDA graphs or compiled
graphs. On vLLM's CPU build the defaults below make a small model run (they are vLLM's own
settings; any given on the command line wins), and glmcheck's vLLM plugin (`vllm_plugin`)
stands in for the GPU-only sparse attention.

A server already running is captured from the outside, through vLLM's own HTTP API:

    VLLM_SERVER_DEV_MODE=1 GLMCHECK_SHARDS_DIR=/tmp/shards vllm serve MODEL --enforce-eager \
        --worker-extension-cls glmcheck_probe.vllm_worker.ProbeWorker [its other arguments]
    python -m glmcheck_probe.vllm_capture --server http://HOST:PORT (--tokens … | --prompt …) \
        --out DIR

installs the probe through vLLM's `/collective_rpc` (opened by dev mode), sends the prompt to
`/v1/completions` with `prompt_logprobs`, and merges what the workers wrote (on this machine's
filesystem: the server must run here). The shard manifests are those the plugin wrote as the
server loaded the weights, into `GLMCHECK_SHARDS_DIR`; without it the capture has a trace only.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

from . import vllm_cuda_tree, vllm_plugin, vllm_probe

# vLLM's CPU build: the reference MLA backend (AMX_MLA takes bf16 only), vLLM's PyTorch RoPE
# (its CPU rotary kernel rotates a 3-D query with more than one head wrongly), a KV cache of
# 1 GiB rather than most of the RAM, and short sequences.
CPU_DEFAULTS = {
    "attention_backend": "CPU_MLA",
    "compilation_config": {"custom_ops": ["-rotary_embedding"]},
    "max_model_len": 256,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 1,
}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def parse(argv):
    ap = argparse.ArgumentParser(
        prog="python -m glmcheck_probe.vllm_capture",
        description="Run one prompt through vLLM with glmcheck's probe in every worker; write "
                    "the merged trace and shard manifest. Other arguments go to vLLM's engine "
                    "(as for `vllm serve`).")
    ap.add_argument("model", nargs="?",
                    help="what vLLM serves: a Hugging Face folder or name, or a GGUF file "
                         "(through vllm-gguf-plugin, with --hf-config-path and --tokenizer "
                         "naming the folder of its config); not with --server")
    ap.add_argument("--server", metavar="URL",
                    help="capture from a running `vllm serve` at URL instead of starting vLLM "
                         "(see the module's doc for how to start it)")
    ap.add_argument("--tp", type=int, help="tensor-parallel size (default 1)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, dest="engine_tp",
                    help="vLLM's spelling of --tp")
    ap.add_argument("--tree", choices=("cpu", "cuda"),
                    help="on vLLM's CPU build, the GLM-5 / DeepSeek-V3.2 model tree to run: "
                         "the CPU tree vLLM picks there (default), or the CUDA tree a GPU runs "
                         "(vllm/models/deepseek_v32/nvidia), built with glmcheck's stand-ins "
                         "for its kernels")
    prompt = ap.add_mutually_exclusive_group()
    prompt.add_argument("--tokens", help="the prompt as token ids, comma-separated")
    prompt.add_argument("--prompt", help="the prompt as text (needs the model's tokenizer)")
    ap.add_argument("--out", required=True, help="a new or empty folder for the capture")
    ap.add_argument("--shards-only", action="store_true",
                    help="load the model and write the shard manifest only: no prompt is run "
                         "(a load whose forward cannot run, or a quick look at the shards)")
    ap.add_argument("--full", action="append", metavar="GLOB",
                    help="stages kept whole (default: the probe's: logits, the residual "
                         "stream, the DSA top-k); others are kept as statistics")
    ours, rest = ap.parse_known_args(argv)
    return ours, rest


def engine_kwargs(model: str, tp: int, rest: list, tokens: bool) -> dict:
    """vLLM's engine arguments from `rest` (vLLM's own parser), with the capture's: eager, the
    probe's worker extension, the tensor-parallel size, and on a CPU the defaults above."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    given = parser.parse_args(["--model", model] + rest)
    defaults = parser.parse_args(["--model", model])
    args = EngineArgs.from_cli_args(given)
    base = EngineArgs.from_cli_args(defaults)
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
              if getattr(args, f.name) != getattr(base, f.name)}
    if current_platform.is_cpu():
        for key, value in CPU_DEFAULTS.items():
            kwargs.setdefault(key, value)
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)
        if tp > 1:
            cores = sorted(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                                  "|".join(str(cores[r % len(cores)]) for r in range(tp)))
    kwargs.update(model=model, tensor_parallel_size=tp, enforce_eager=True,
                  worker_extension_cls="glmcheck_probe.vllm_worker.ProbeWorker")
    if tokens:
        kwargs.setdefault("skip_tokenizer_init", True)
    return kwargs


def capture(model: str, tp: int, out: str, tokens=None, prompt=None, rest=(), full=None,
            tree=None, shards_only=False) -> dict:
    """Start vLLM with `LLM`, run the capture; a summary of what was written. With
    `shards_only`, the shard manifest of the load alone."""
    from vllm import LLM

    ranks_dir = _fresh(out)
    started = time.time()
    # Read by glmcheck's plugin in each worker, which writes the shard manifests there.
    os.environ[vllm_plugin.SHARDS_ENV] = os.path.abspath(ranks_dir)
    if tree:
        os.environ[vllm_cuda_tree.TREE_ENV] = tree
    llm = LLM(**engine_kwargs(model, tp, list(rest), shards_only or tokens is not None))
    ready = time.time()
    try:
        if shards_only:
            manifests = [os.path.join(ranks_dir, f"shards.rank{r}.json") for r in range(tp)]
            summary = {"tp": tp}
            notes = _merge_shards(out, manifests, summary)
            return {**summary, "notes": notes, "start_s": round(ready - started, 2)}
        return {**_run(llm, model, ranks_dir, out, tokens, prompt, full),
                "start_s": round(ready - started, 2), "run_s": round(time.time() - ready, 2)}
    finally:
        # vLLM's engine core and workers stopped here: left to the interpreter's exit, the
        # workers of a multi-process run can outlive the capture, spinning.
        llm.llm_engine.engine_core.shutdown()


def _run(llm, model: str, ranks_dir: str, out: str, tokens, prompt, full) -> dict:
    """The probe installed in every worker, the prompt run, the ranks' files merged."""
    from vllm import SamplingParams

    source = os.path.abspath(model) if os.path.exists(model) else model
    installed = _installed(llm.collective_rpc("glmcheck_install", args=(ranks_dir, source, full)))
    request = {"prompt_token_ids": tokens} if tokens is not None else prompt
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    result = llm.generate([request], params, use_tqdm=False)[0]
    finished = llm.collective_rpc("glmcheck_finish")
    return {**_merge(out, installed, finished), "next_token": list(result.outputs[0].token_ids)}


def capture_server(url: str, out: str, tokens=None, prompt=None, full=None) -> dict:
    """Run the capture on a running `vllm serve` (started with the probe's worker extension and
    `VLLM_SERVER_DEV_MODE=1`, which opens vLLM's `/collective_rpc`); a summary."""
    ranks_dir = os.path.abspath(_fresh(out))
    served = _http(url, "/v1/models")["data"][0]
    source = served.get("root") or served["id"]
    installed = _installed(_rpc(url, "glmcheck_install",
                                [ranks_dir, source, json.dumps(full) if full else ""]))
    body = {"model": served["id"], "prompt": tokens if tokens is not None else prompt,
            "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
    completion = _http(url, "/v1/completions", body)
    finished = _rpc(url, "glmcheck_finish", [])
    summary = _merge(out, installed, finished)
    return {**summary, "model": source, "next_text": completion["choices"][0].get("text")}


def _fresh(out: str) -> str:
    """The capture's folder, which must be new or empty; its `ranks` folder."""
    if os.path.isdir(out) and os.listdir(out):
        raise CaptureError(f"{out}: already holds files; give the capture a new folder")
    return os.path.join(out, "ranks")


def _installed(ranks: list) -> list:
    for rank in ranks:
        if "refused" in rank:
            raise CaptureError(f"rank {rank['rank']}: {rank['refused']}")
    return ranks


def _merge(out: str, installed: list, finished: list) -> dict:
    """The ranks' traces and shard manifests merged into `out`; what was written."""
    traces = [f["trace"] for f in sorted(finished, key=lambda f: f["rank"])]
    trace = os.path.join(out, "run.trace")
    merged = vllm_probe.merge_traces(trace, traces)
    summary = {"trace": trace, "tp": merged["tp"], "tokens": merged["tokens"],
               "stages": len(merged["stages"])}
    manifests = [r["shards"] for r in sorted(installed, key=lambda r: r["rank"])]
    notes = _merge_shards(out, manifests, summary)
    return {**summary, "notes": merged["producer"].get("notes", []) + notes}


def _merge_shards(out: str, manifests: list, summary: dict) -> list:
    """The ranks' shard manifests merged into `out/shards.json` (its path put in `summary`);
    notes on why there is none."""
    for m in manifests:
        error = (m or "") + ".error"
        if os.path.exists(error):
            raise CaptureError(f"{error}: " + open(error).read().strip())
    if all(m and os.path.exists(m) for m in manifests):
        summary["shards"] = os.path.join(out, "shards.json")
        vllm_probe.merge_shard_manifests(summary["shards"], manifests)
        return []
    return [f"no shard manifest: vLLM was started without {vllm_plugin.SHARDS_ENV} (or without "
            "glmcheck's plugin installed), so the weights as loaded were not written"]


class CaptureError(Exception):
    """Why a capture cannot be made: printed as one line, exit code 2."""


def _http(url: str, path: str, body=None) -> dict:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url.rstrip("/") + path, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace").strip()
        hint = (" (start the server with VLLM_SERVER_DEV_MODE=1 for /collective_rpc)"
                if path == "/collective_rpc" and e.code == 404 else "")
        raise CaptureError(f"{url}{path}: HTTP {e.code}{hint}: {detail[:300]}") from None
    except (urllib.error.URLError, OSError) as e:
        raise CaptureError(f"{url}{path}: {e}") from None


def _rpc(url: str, method: str, args: list) -> list:
    """vLLM's `/collective_rpc` (dev mode): the workers' results."""
    results = _http(url, "/collective_rpc", {"method": method, "args": args})["results"]
    if any(not isinstance(r, dict) for r in results):
        raise CaptureError(f"{url}/collective_rpc {method}: {results[0]!r} (start the server "
                           "with --worker-extension-cls glmcheck_probe.vllm_worker.ProbeWorker)")
    return results


def _fail(message: str) -> None:
    print(f"vllm_capture: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> None:
    ours, rest = parse(sys.argv[1:] if argv is None else argv)
    tokens = None
    if ours.tokens is not None:
        try:
            tokens = [int(t) for t in ours.tokens.split(",") if t.strip()]
        except ValueError:
            _fail(f"--tokens {ours.tokens!r}: not comma-separated integers")
        if not tokens:
            _fail("--tokens: no token ids")
    if ours.tp and ours.engine_tp and ours.tp != ours.engine_tp:
        _fail(f"--tp {ours.tp} and --tensor-parallel-size {ours.engine_tp} disagree; give one")
    ours.tp = ours.tp or ours.engine_tp
    if ours.server:
        extra = ([ours.model] if ours.model else []) + rest + [
            f"--{k} {v}" for k, v in (("tp", ours.tp), ("tree", ours.tree)) if v]
        if extra:
            _fail(f"--server: {' '.join(extra)}: the model and engine arguments belong to the "
                  "server's own command line")
    if not ours.server and not ours.model:
        _fail("give MODEL, or --server URL of a running vLLM")
    if ours.shards_only and (ours.server or tokens or ours.prompt):
        _fail("--shards-only runs no prompt and starts vLLM itself: give MODEL without --tokens, "
              "--prompt or --server")
    if not ours.shards_only and tokens is None and ours.prompt is None:
        _fail("give the prompt: --tokens IDS or --prompt TEXT (or --shards-only)")
    try:
        if ours.server:
            summary = capture_server(ours.server, ours.out, tokens, ours.prompt, ours.full)
        else:
            summary = capture(ours.model, ours.tp or 1, ours.out, tokens, ours.prompt, rest,
                              ours.full, ours.tree, ours.shards_only)
    except (vllm_probe.UnknownModel, CaptureError) as e:
        _fail(str(e))
    print(json.dumps(summary))
    model = summary.get("model", ours.model)
    actual = f" --actual {summary['shards']}" if "shards" in summary else ""
    if "trace" in summary:
        print(f"glmcheck bisect {model} --candidate {summary['trace']}{actual}", file=sys.stderr)
    elif actual:
        print(f"glmcheck shards {model}{actual}", file=sys.stderr)


if __name__ == "__main__":
    main()
