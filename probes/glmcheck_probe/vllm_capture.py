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

The forward runs eagerly (`enforce_eager`), for hooks do not see inside CUDA graphs or compiled
graphs. On vLLM's CPU build the defaults below make a small model run (they are vLLM's own
settings; any given on the command line wins), and glmcheck's vLLM plugin (`vllm_plugin`)
stands in for the GPU-only sparse attention.
"""

import argparse
import dataclasses
import glob
import json
import os
import sys
import time

from . import vllm_plugin, vllm_probe

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
    ap.add_argument("model", help="what vLLM serves: a Hugging Face folder or name, a GGUF")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    prompt = ap.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", help="the prompt as token ids, comma-separated")
    prompt.add_argument("--prompt", help="the prompt as text (needs the model's tokenizer)")
    ap.add_argument("--out", required=True, help="a new or empty folder for the capture")
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


def capture(model: str, tp: int, out: str, tokens=None, prompt=None, rest=(), full=None) -> dict:
    """Run the capture; a summary of what was written."""
    from vllm import LLM, SamplingParams

    if os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"{out}: already holds files; give the capture a new folder")
    ranks_dir = os.path.join(out, "ranks")
    started = time.time()
    # Read by glmcheck's plugin in each worker, which writes the shard manifests there.
    os.environ[vllm_plugin.SHARDS_ENV] = os.path.abspath(ranks_dir)
    llm = LLM(**engine_kwargs(model, tp, list(rest), tokens is not None))
    ready = time.time()
    source = os.path.abspath(model) if os.path.exists(model) else model
    installed = llm.collective_rpc("glmcheck_install", args=(ranks_dir, source, full))
    for rank in installed:
        if "refused" in rank:
            raise vllm_probe.UnknownModel(f"rank {rank['rank']}: {rank['refused']}")
    request = {"prompt_token_ids": tokens} if tokens is not None else prompt
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    result = llm.generate([request], params, use_tqdm=False)[0]
    finished = llm.collective_rpc("glmcheck_finish")
    refused = sorted(glob.glob(os.path.join(ranks_dir, "shards.rank*.json.error")))
    if refused:
        raise vllm_probe.UnknownModel(f"{refused[0]}: " + open(refused[0]).read().strip())
    ranks = sorted(f["rank"] for f in finished)
    trace = os.path.join(out, "run.trace")
    shards = os.path.join(out, "shards.json")
    merged = vllm_probe.merge_traces(trace, [os.path.join(ranks_dir, f"rank{r}.trace")
                                             for r in ranks])
    vllm_probe.merge_shard_manifests(shards, [os.path.join(ranks_dir, f"shards.rank{r}.json")
                                              for r in ranks])
    return {"trace": trace, "shards": shards, "tp": tp, "tokens": merged["tokens"],
            "stages": len(merged["stages"]), "notes": merged["producer"].get("notes", []),
            "next_token": list(result.outputs[0].token_ids),
            "start_s": round(ready - started, 2), "run_s": round(time.time() - ready, 2)}


def main(argv=None) -> None:
    ours, rest = parse(sys.argv[1:] if argv is None else argv)
    tokens = None
    if ours.tokens is not None:
        try:
            tokens = [int(t) for t in ours.tokens.split(",") if t.strip()]
        except ValueError:
            sys.exit(f"vllm_capture: --tokens {ours.tokens!r}: not comma-separated integers")
        if not tokens:
            sys.exit("vllm_capture: --tokens: no token ids")
    try:
        summary = capture(ours.model, ours.tp, ours.out, tokens, ours.prompt, rest, ours.full)
    except (vllm_probe.UnknownModel, FileExistsError) as e:
        print(f"vllm_capture: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(summary))
    print(f"glmcheck bisect {ours.model} --candidate {summary['trace']} "
          f"--actual {summary['shards']}", file=sys.stderr)


if __name__ == "__main__":
    main()
