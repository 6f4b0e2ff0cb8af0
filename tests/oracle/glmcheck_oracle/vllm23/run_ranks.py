"""Load a glm-dsa GGUF into vLLM 0.23's `GlmMoeDsaForCausalLM` at tensor parallelism N, one
process per rank (forked after importing vLLM once) over gloo (vLLM's own `init_distributed_environment` and
`initialize_model_parallel`), write the probe's shard manifest of what each rank holds, and
with `--tokens` run vLLM's forward on them with the probe's hooks installed.

Usage: python -m glmcheck_oracle.vllm23.run_ranks GGUF --hf-config DIR --tp N --out DIR
           [--fault FAULT]
           [--tokens 1,2,3 [--dtype float32|bfloat16|float16] [--full GLOB ...]
            [--cpu-rope-kernel]] [--check-dequant]
           [--rename-class OLD=NEW] [--rename-module OLD=NEW]
           [--timeout SECONDS]

Writes DIR/shards.rank{r}.json (one per rank) and DIR/shards.json (merged); with `--tokens`,
DIR/run.trace (the ranks' traces merged). Prints one JSON line: tp, fault, per-rank seconds,
wall seconds. Runs on vLLM's CPU build (`scripts/setup-vllm`); see `cpu_shims.py` for the four
platform decisions it changes and `gpu_stand_ins.py` for the GPU kernels the forward needs.

Faults: `unsharded-kv-b` (the loader patch, `glm_dsa_load.py`), `q4k-high-scales` and
`fp16-no-residual-rescale` (`gpu_stand_ins.py`), `rope-theta-10x` (every rotary embedding of
the model rebuilt with 10 times its base, as a config read wrongly would build it),
`skip-o-proj-all-reduce` (layer 1's o_proj leaving out its all-reduce), `logits-vocab-rotated`
(the logits gather returning the ranks' vocabulary blocks in rotated order).
"""

import argparse
import glob
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import uuid


def rank_main(args) -> None:
    """One rank: build the model with vLLM's classes, load it, write this rank's manifest."""
    started = time.time()
    import torch
    from vllm.config import (CompilationConfig, ModelConfig, ParallelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.quantization.gguf import GGUFConfig
    from vllm.model_executor.model_loader.utils import (initialize_model,
                                                        process_weights_after_loading)

    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.quantization.gguf import DEQUANT_TYPES, UNQUANTIZED_TYPES
    from vllm.utils.torch_utils import set_default_torch_dtype

    from glmcheck_oracle.vllm23 import cpu_shims, glm_dsa_load, gpu_stand_ins
    from glmcheck_probe import vllm_probe

    torch.set_num_threads(1)
    if args.tokens:  # a load alone runs no GPU kernel: vLLM's CPU build as it is
        gpu_stand_ins.install(args.fault if args.fault in gpu_stand_ins.FAULTS else None)
    cfg = glm_dsa_load.hf_config(args.gguf, args.hf_config)
    weights = glm_dsa_load.GgufWeights(args.gguf, cfg["num_hidden_layers"],
                                       DEQUANT_TYPES | UNQUANTIZED_TYPES)
    model_config = ModelConfig(model=args.hf_config, dtype=args.dtype, enforce_eager=True,
                               max_model_len=64, skip_tokenizer_init=True)
    # vLLM's CPU rotary kernel (`ops.rotary_embedding`) rotates a 3-D query [T, heads, d]
    # wrongly for heads > 1 (2-D [T, heads·d] is right), and MLA passes q 3-D: RoPE runs
    # vLLM's own PyTorch version, as `custom_ops` allows, unless --cpu-rope-kernel.
    custom_ops = [] if args.cpu_rope_kernel else ["-rotary_embedding"]
    vllm_config = VllmConfig(model_config=model_config,
                             parallel_config=ParallelConfig(tensor_parallel_size=args.tp),
                             compilation_config=CompilationConfig(custom_ops=custom_ops))
    # What GGUFModelLoader.load_model does: float weights' modules left unquantized.
    vllm_config.quant_config = GGUFConfig(unquantized_modules=weights.unquantized_modules())
    cpu_shims.install()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(args.tp, args.rank, f"file://{args.rendezvous}",
                                     args.rank, backend="gloo")
        initialize_model_parallel(args.tp)
        loading = time.time()
        # As `GGUFModelLoader.load_model`: parameters in the model's dtype, on the device.
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
            glm_dsa_load.load(model, weights,
                              args.fault if args.fault in glm_dsa_load.FAULTS else None)
            process_weights_after_loading(model, model_config, torch.device("cpu"))
        if args.fault == "rope-theta-10x":
            rope_base_times(model, 10.0)
        elif args.fault == "skip-o-proj-all-reduce":
            skip_o_proj_all_reduce(model, layer=1)
        elif args.fault == "logits-vocab-rotated":
            rotate_vocab_blocks(args.tp)
        rename(model, args.rename_class, args.rename_module)
        loaded = time.time()
        path = os.path.join(args.out, f"shards.rank{args.rank}.json")
        vllm_probe.write_shard_manifest(model, path, args.rank, args.tp, source=args.gguf,
                                        check_dequant=args.check_dequant)
        written = time.time()
        if args.tokens:
            probe = vllm_probe.install(model, os.path.join(args.out, "ranks"), args.rank,
                                       args.tp, full=tuple(args.full or vllm_probe.ENGINE_FULL),
                                       source=args.gguf)
            ids = torch.tensor(args.tokens, dtype=torch.long)
            with set_forward_context(None, vllm_config), torch.inference_mode():
                hidden = model(ids, torch.arange(len(args.tokens)))
                model.compute_logits(hidden)
            probe.finish()
    timing = {"rank": args.rank, "start_s": round(loading - started, 2),
              "load_s": round(loaded - loading, 2),
              "manifest_s": round(written - loaded, 2),
              "forward_s": round(time.time() - written, 2)}
    with open(os.path.join(args.out, f"timing.rank{args.rank}.json"), "w") as f:
        json.dump(timing, f)


def remove_shared_memory(ident: str) -> None:
    """Unlink the shared-memory segments vLLM's CPU communicator made under `ident`."""
    for path in glob.glob(os.path.join("/dev/shm", glob.escape(ident) + "-*")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def rename(model, classes, modules) -> None:
    """A vLLM whose code has moved on: classes given new names, submodules new attribute names
    (what the probe must refuse, naming the module, rather than record wrongly)."""
    for old, new in classes:
        for m in model.modules():
            if type(m).__name__ == old:
                m.__class__ = type(new, (type(m),), {})
    for old, new in modules:
        for m in list(model.modules()):
            if old in m._modules:
                m._modules[new] = m._modules.pop(old)


def rope_base_times(model, factor: float) -> None:
    """Every rotary embedding of `model` (each shared instance once) with its base times
    `factor` and its cos/sin cache computed again from it."""
    seen = set()
    for module in model.modules():
        if hasattr(module, "base") and hasattr(module, "_compute_cos_sin_cache") and id(module) not in seen:
            seen.add(id(module))
            module.base = module.base * factor
            cache = module._compute_cos_sin_cache()
            module.cos_sin_cache = cache.to(module.cos_sin_cache.device, dtype=module.cos_sin_cache.dtype)
    if not seen:
        raise SystemExit("run_ranks: rope-theta-10x: the model has no rotary embedding")


def skip_o_proj_all_reduce(model, layer: int) -> None:
    """Layer `layer`'s o_proj (RowParallelLinear, `reduce_results` still true) leaving out the
    all-reduce `linear.py`'s forward promises: each rank goes on with its partial sum, as a
    collective dropped by a bug would leave it."""
    import vllm.model_executor.layers.linear as linear

    o_proj = model.model.layers[layer].self_attn.o_proj
    real, skipping = linear.tensor_model_parallel_all_reduce, []
    linear.tensor_model_parallel_all_reduce = lambda x: x if skipping else real(x)
    forward = o_proj.forward

    def skipped(*args, **kwargs):
        skipping.append(True)
        try:
            return forward(*args, **kwargs)
        finally:
            skipping.clear()

    o_proj.forward = skipped


def rotate_vocab_blocks(tp: int) -> None:
    """The logits gather of `logits_processor.py` handing back the ranks' vocabulary blocks in
    rotated order (rank 1's block first, rank 0's last): a gather that orders its parts wrongly."""
    import torch
    import vllm.model_executor.layers.logits_processor as lp

    for name in ("tensor_model_parallel_all_gather", "tensor_model_parallel_gather"):
        real = getattr(lp, name)

        def rotated(x, *args, real=real, **kwargs):
            out = real(x, *args, **kwargs)
            if out is None:
                return out
            blocks = list(out.chunk(tp, dim=-1))
            return torch.cat(blocks[1:] + blocks[:1], dim=-1)

        setattr(lp, name, rotated)


def without_glmcheck_plugins() -> None:
    """vLLM loads every `vllm.general_plugins` entry point it finds, in each process it starts
    (the model registry's inspection subprocess among them). glmcheck's plugin and the vLLM 0.32
    tests' fault plugin are installed in this venv too (`scripts/setup-vllm`), but they are vLLM
    0.32's: this script installs the probe's hooks itself, so vLLM 0.23 is allowed only the other
    plugins, unless `VLLM_PLUGINS` already says which."""
    from importlib.metadata import entry_points

    if "VLLM_PLUGINS" not in os.environ:
        others = [e.name for e in entry_points(group="vllm.general_plugins")
                  if not e.value.startswith(("glmcheck_probe", "glmcheck_oracle"))]
        os.environ["VLLM_PLUGINS"] = ",".join(others)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--hf-config", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--fault", choices=["unsharded-kv-b", "q4k-high-scales",
                                        "fp16-no-residual-rescale", "rope-theta-10x",
                                        "skip-o-proj-all-reduce", "logits-vocab-rotated"])
    ap.add_argument("--tokens", type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--full", action="append", help="stages kept whole (default: the probe's)")
    ap.add_argument("--cpu-rope-kernel", action="store_true",
                    help="keep vLLM's CPU rotary kernel (wrong for MLA's 3-D q)")
    ap.add_argument("--rename-class", action="append", default=[], metavar="OLD=NEW",
                    type=lambda s: s.split("=", 1), help="rename a vLLM class (probe test)")
    ap.add_argument("--rename-module", action="append", default=[], metavar="OLD=NEW",
                    type=lambda s: s.split("=", 1), help="rename a submodule (probe test)")
    ap.add_argument("--check-dequant", action="store_true",
                    help="record the engine's dequantization of each quantized shard")
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    without_glmcheck_plugins()

    started = time.time()
    os.makedirs(args.out, exist_ok=True)
    # The ranks meet through a file, not a TCP port another run could take in between.
    args.rendezvous = os.path.join(os.path.abspath(args.out), ".rendezvous")
    if os.path.exists(args.rendezvous):
        os.remove(args.rendezvous)
    # Import vLLM once and fork the ranks from here: each rank then starts in a second, not
    # after half a minute of imports (the same modules, loaded before any thread or process
    # group exists).
    import vllm.model_executor.models.deepseek_v2  # noqa: F401
    import vllm.model_executor.model_loader.utils  # noqa: F401
    ctx = multiprocessing.get_context("fork")
    # vLLM's CPU communicator names its shared memory after VLLM_DIST_IDENT and never unlinks
    # it: a name of this run's own (not a process id the system hands out again) and the
    # files removed when the ranks are gone, or a later run fails to create them (EEXIST).
    ident = f"glmcheck-{uuid.uuid4().hex[:16]}"
    os.environ["VLLM_DIST_IDENT"] = ident
    # Its message queues' ZMQ sockets go to files under VLLM_RPC_BASE_PATH (the temp folder by
    # default), named afresh each time and never removed: a folder of this run's own, removed
    # with them.
    sockets = tempfile.mkdtemp(prefix="glmcheck-vllm-ipc-")
    os.environ["VLLM_RPC_BASE_PATH"] = sockets
    procs = []
    try:
        for r in range(args.tp):
            rank_args = argparse.Namespace(**{**vars(args), "rank": r})
            procs.append(ctx.Process(target=rank_main, args=(rank_args,)))
            procs[-1].start()
        deadline = started + args.timeout
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.time()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
                p.join()
            sys.exit(f"run_ranks: timed out after {args.timeout} s")
    finally:
        remove_shared_memory(ident)
        shutil.rmtree(sockets, ignore_errors=True)
    if os.path.exists(args.rendezvous):
        os.remove(args.rendezvous)
    codes = [p.exitcode for p in procs]
    if any(codes):
        sys.exit(f"run_ranks: rank exit codes {codes}")

    from glmcheck_probe import vllm_probe
    paths = [os.path.join(args.out, f"shards.rank{r}.json") for r in range(args.tp)]
    vllm_probe.merge_shard_manifests(os.path.join(args.out, "shards.json"), paths)
    if args.tokens:
        traces = [os.path.join(args.out, "ranks", f"rank{r}.trace") for r in range(args.tp)]
        vllm_probe.merge_traces(os.path.join(args.out, "run.trace"), traces)
    ranks = [json.load(open(os.path.join(args.out, f"timing.rank{r}.json")))
             for r in range(args.tp)]
    print(json.dumps({"tp": args.tp, "fault": args.fault, "ranks": ranks,
                      "wall_s": round(time.time() - started, 2)}))


if __name__ == "__main__":
    main()
