"""Make an SGLang debug-dump folder with SGLang's own dumper: one prefill of TOKENS (one
request) through the fixture's model of HF_DIR (any member of the family) at TP ranks (gloo
processes on this machine), the dumper in `all` non-intrusive mode registered on the model and
stepped after each forward, as SGLang's model runner does (model_executor/model_runner.py:
1394-1396, :1900-1901).

Usage: python -m glmcheck_oracle.sglang.dump HF_DIR TOKENS OUT_DIR TP
           [--dtype bf16|f32] [--fault NAME] [--steps N] [--mechanism dumper|tensor-hook]
           [--fuse-shared-experts]
       python -m glmcheck_oracle.sglang.dump HF_DIR TOKENS --check [--tp 1,2,4]
           [--fuse-shared-experts]

Writes OUT_DIR/glmcheck/*.pt (DUMPER_DIR=OUT_DIR, DUMPER_EXP_NAME=glmcheck; an older
OUT_DIR/glmcheck is removed first) and prints that folder. `--steps N` adds N-1 greedy
decode steps of one token each, each its own dumper step (DSA models only: SGLang decodes the
others on the absorbed MLA path, which the fixture does not build).

`--fuse-shared-experts` builds the MoE layers as SGLang does by default for GLM-5 on CUDA
(models/deepseek_v2.py:3319-3390 with glm4_moe.py:1285; the fixture skips the allow-list of
256/384 routed experts as --enforce-shared-experts-fusion does): no `mlp.shared_experts`; the
shared expert is `mlp.experts`' expert n_routed_experts (w13/w2 one longer, split over TP as
the routed ones); `mlp.topk` returns top_k+1 columns, the last with id n_routed_experts and
weight 1/routed_scaling_factor, the routed weights renormalized among themselves; so
`mlp.experts` returns routed_scaling_factor·Σ w·expert(x) + shared(x), which `mlp` returns.

`--mechanism tensor-hook` uses SGLang's older mechanism instead, the one behind
`--debug-tensor-dump-output-folder OUT_DIR` (debug_utils/tensor_dump_forward_hook.py, real and
unmodified, registered on each rank's model after loading as the model runner does:
model_runner.py:1385 → load_model_utils.py:176-197, `register_forward_hook_for_model(model,
OUT_DIR, None, tp_size, tp_rank, pp_rank=0)`, all layers). It writes
OUT_DIR/TP{r}_PP0_Rank{r}_pid{pid}/Pass{NNNNN}.pt, one per forward per rank, each saved when
the top-level `model` (DeepseekV2Model) returns: its own output and the logits processor's,
which come after, land in the next pass's file, and the last forward's never (as in SGLang,
which writes nothing at exit). Older TP*_PP*_Rank*_pid* folders in OUT_DIR are removed first;
prints OUT_DIR. `--check` dumps nothing: it runs
transformers' class of the checkpoint and this model at each TP in f32 and prints, per TP, the
largest logit difference over all positions relative to max|logit| and the difference from
the first TP listed (one JSON line each), exiting 1 above 1e-4.
"""

import argparse
import glob
import json
import multiprocessing
import os
import shutil
import sys
import tempfile

EXP_NAME = "glmcheck"
DTYPES = {"bf16": "bfloat16", "f32": "float32"}


def _batch(forward_batch_cls, tokens, start, kv_cache):
    """The ForwardBatch of one request's `tokens` at positions start.. (dtypes as SGLang's:
    managers/schedule_batch.py:2786; rids are strings, forward_batch_info.py:636)."""
    import torch

    n = start + len(tokens)
    return forward_batch_cls(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.arange(start, n, dtype=torch.int64),
        seq_lens=torch.tensor([n], dtype=torch.int64),
        req_pool_indices=torch.tensor([0], dtype=torch.int64),
        rids=["glmcheck-0"], kv_cache=kv_cache)


def rank_main(rank, size, rendezvous, args, result_path):
    """One TP rank: build the model, then dump (or, with --check, save every position's
    logits to result_path)."""
    import torch
    import torch.distributed as dist

    from glmcheck_oracle.sglang import standins

    torch.set_num_threads(1)
    sys.stdout = sys.stderr  # the dumper's log lines; stdout is left to the folder's path
    dumper = hook = None
    if not args.check and args.mechanism == "tensor-hook":
        standins.install(rank, size)
        hook = standins.load_tensor_hook()
    elif not args.check:
        os.environ.update(DUMPER_ENABLE="1", DUMPER_NON_INTRUSIVE_MODE="all",
                          DUMPER_DIR=args.out_dir, DUMPER_EXP_NAME=EXP_NAME,
                          DUMPER_ENABLE_OUTPUT_CONSOLE="0")
        standins.install(rank, size)
        dumper = standins.load_dumper()
    if size > 1:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                world_size=size)
    from glmcheck_oracle.sglang import model as glm, weights

    dtype = getattr(torch, DTYPES[args.dtype])
    cfg = weights.config(args.hf_dir)
    if args.fuse_shared_experts:
        cfg["num_fused_shared_experts"] = cfg["n_shared_experts"]
    model = glm.DeepseekV2ForCausalLM(weights.load(args.hf_dir, cfg, dtype, args.fault), cfg,
                                      dtype, args.fault)
    tokens = [int(x) for x in args.tokens.split(",")]
    with torch.no_grad():
        if args.check:
            batch = _batch(standins.ForwardBatch, tokens, 0, {})
            hidden = model.model(batch.input_ids, batch.positions, batch)
            logits = model.all_logits(hidden)  # a gather: every rank takes part
            if rank == 0:
                torch.save(logits, result_path)
        else:
            if hook is not None:
                # load_model_utils.py:190: (model, folder, debug_tensor_dump_layers=None,
                # tp_size, tp_rank, pp_rank), the root being the model runner's self.model.
                hook.register_forward_hook_for_model(model, args.out_dir, None, size, rank, 0)
            else:
                dumper.register_non_intrusive_dumper(model)
            kv_cache, new, start = {}, tokens, 0
            for _ in range(args.steps):
                batch = _batch(standins.ForwardBatch, new, start, kv_cache)
                # runner/eager_runner.py:361: model.forward(input_ids, positions, forward_batch)
                out = model.forward(batch.input_ids, batch.positions, batch)
                if dumper is not None:
                    dumper.step()
                start += len(new)
                new = [int(out.next_token_logits[0].argmax())]
    if size > 1:
        dist.destroy_process_group()


def run_ranks(args, size, result_path=None):
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=rank_main,
                             args=(r, size, os.path.join(tmp, "rendezvous"), args, result_path))
                 for r in range(size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise SystemExit(f"TP {size}: ranks {failed} failed")


def check(args):
    """This model at each TP against transformers' class of the checkpoint, f32, all
    positions."""
    import torch

    from glmcheck_oracle.hf.load import causal_lm

    tokens = [int(x) for x in args.tokens.split(",")]
    reference = causal_lm(args.hf_dir)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0].float()
    scale = expected.abs().max().item()
    worst, first = 0.0, None
    with tempfile.TemporaryDirectory() as tmp:
        for size in [int(x) for x in args.tp.split(",")]:
            path = os.path.join(tmp, f"logits.tp{size}.pt")
            run_ranks(args, size, path)
            got = torch.load(path)
            first = got if first is None else first
            diff = (got - expected).abs().max().item()
            worst = max(worst, diff / scale)
            print(json.dumps({"tp": size, "tokens": len(tokens), "max_abs_diff": diff,
                              "max_abs_logit": scale, "relative": diff / scale,
                              "vs_first_tp_max_abs_diff": (got - first).abs().max().item(),
                              "same_argmax": bool((got.argmax(-1) == expected.argmax(-1)).all())}))
    return 0 if worst <= 1e-4 else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir")
    parser.add_argument("tokens", help="comma-separated token ids of the one request")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("tp_size", nargs="?", type=int)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--fault")
    parser.add_argument("--steps", type=int, default=1,
                        help="forward passes: the prefill, then greedy one-token decodes")
    parser.add_argument("--mechanism", choices=("dumper", "tensor-hook"), default="dumper",
                        help="SGLang's dumper.py, or its --debug-tensor-dump-output-folder hooks")
    parser.add_argument("--fuse-shared-experts", action="store_true",
                        help="SGLang's default on CUDA for GLM-5: the shared expert fused into "
                        "the routed experts as expert n_routed_experts")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--tp", default="1,2,4", help="with --check: the TP sizes")
    args = parser.parse_args(argv)
    from glmcheck_oracle.sglang import layers, model as glm, weights

    cfg = weights.config(args.hf_dir)
    n_tokens = len(args.tokens.split(",")) + args.steps - 1
    if args.fuse_shared_experts and cfg.get("n_shared_experts") != 1:
        # deepseek_weight_loader.py:287-288 (and the allow-list, dv2:3357-3369, which the
        # fixture bypasses for its 8 experts as --enforce-shared-experts-fusion does, :3340)
        parser.error(f"--fuse-shared-experts needs n_shared_experts 1, not "
                     f"{cfg.get('n_shared_experts')}")
    if cfg["dsa"] and n_tokens > cfg["index_topk"]:
        # SGLang prefills DSA with dense MHA only up to index_topk tokens
        # (layers/attention/dsa_backend.py:4064, arg_groups/model_hook.py:290); beyond,
        # it runs the absorbed MLA path with the indexer's top-k, which this fixture lacks.
        parser.error(f"{n_tokens} tokens > index_topk {cfg['index_topk']}")
    if not cfg["dsa"] and args.steps > 1:
        # Without DSA a decode step, no extend, takes the absorbed MLA path
        # (attention_backend_handler.py:125-141), which this fixture does not build.
        parser.error("--steps > 1 needs a DSA model; the dense MLA decode is not modelled")
    if args.fault == "yarn-mscale-dropped" and not (
            cfg["rope_scaling"] and layers.mla_softmax_scale(cfg["rope_scaling"], 1.0) != 1.0):
        parser.error("--fault yarn-mscale-dropped needs YaRN with an mscale² other than 1")
    if args.fault == "group-limit-ignored" and cfg["topk_group"] >= cfg["n_group"]:
        parser.error("--fault group-limit-ignored needs topk_group < n_group")
    if args.check:
        args.dtype = "f32"
        return check(args)
    if args.out_dir is None or args.tp_size is None:
        parser.error("OUT_DIR and TP are required unless --check")
    if args.fault is not None and args.fault not in glm.FAULTS:
        parser.error(f"--fault must be one of {', '.join(glm.FAULTS)}")
    args.out_dir = os.path.abspath(args.out_dir)
    if args.mechanism == "tensor-hook":
        for old in glob.glob(os.path.join(args.out_dir, "TP*_PP*_Rank*_pid*")):
            shutil.rmtree(old, ignore_errors=True)
        run_ranks(args, args.tp_size)
        print(args.out_dir)
        return 0
    shutil.rmtree(os.path.join(args.out_dir, EXP_NAME), ignore_errors=True)
    run_ranks(args, args.tp_size)
    print(os.path.join(args.out_dir, EXP_NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
