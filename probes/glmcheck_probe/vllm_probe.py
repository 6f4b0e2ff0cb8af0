"""Hook vLLM's GLM-5 / DeepSeek-V2 model classes in each tensor-parallel worker: record the
docs/design.md §4 stages of one forward as a per-rank glmcheck trace, and write the worker's shard
manifest (every parameter's local shape, dtype, hash and statistics; a GGUF model's quantized
parameters as their raw bytes, manifest version 2, through `vllm_gguf`) in the format
`glmcheck shards --actual` reads.

In each worker, on the loaded model (see probes/docs/vllm.md for the `collective_rpc` call):

    from glmcheck_probe import vllm_probe
    probe = vllm_probe.install(model, "out", rank, world_size)       # hooks; records 1 forward
    vllm_probe.write_shard_manifest(model, f"out/shards.rank{rank}.json", rank, world_size)
    ... run one prompt ...
    probe.finish()

then once, anywhere:

    python -m glmcheck_probe.vllm_probe merge-trace run.trace out/rank*.trace
    python -m glmcheck_probe.vllm_probe merge-shards shards.json out/shards.rank*.json

The module tree is recognised by module path and class name only (no vLLM import), so the probe
knows exactly the names in `vllm_model`; a parameter or a hooked module it does not know raises
`UnknownModel` naming it, never a trace that silently lacks stages.

This module is the probe's entry point: `install`, the merge of the ranks' traces, and the merge
commands. The parts live beside it, one job each: `vllm_model` (the names the probe knows),
`vllm_hooks` (the hooks and the stages they record), `vllm_shards` (the shard manifest); their
public names are importable from here as well.
"""

import argparse
import json
import os
import shutil

from .trace import MANIFEST
# The names other modules and the tests import from here, wherever they are defined.
from .vllm_hooks import ENGINE_FULL, Probe
from .vllm_model import (ABSORBED, ATTENTION, BLOCK_SCALE, COLUMN, CUDA_ATTENTION, CUDA_LAYER,
                         CUDA_MODEL, DERIVED, DTYPES, EMBED, FP8, FUSED_MOE, GATE, GGUF_TYPE,
                         GGUF_WEIGHT, INDEXER, LAYER, LAYER_NAME, LAYER_NORM, LAYER_PARAMS,
                         LM_HEAD, LOGITS, MERGED, MLA_OP, MLP, MOE, QUANT_SUFFIX, REPLICATED,
                         RMS_NORM, ROPE, ROUTED_EXPERTS, ROW, TOP_PARAMS, UnknownModel)
from .vllm_shards import (HASH_LIMIT, SHARDS_FORMAT, SHARDS_VERSION, SHARDS_VERSION_QUANT,
                          _write_json, check_parameters, merge_shard_manifests, shard_entry,
                          write_shard_manifest)


def install(model, out_dir: str, rank: int, world_size: int, full=ENGINE_FULL,
            source: str = None) -> Probe:
    """Check `model` (vLLM's GlmMoeDsaForCausalLM / DeepseekV2ForCausalLM on this worker) and
    hook it: the next forward, with the logits computed after it, is written to
    `out_dir/rank{rank}.trace`. Raises `UnknownModel` naming the first module or parameter the
    probe does not know."""
    check_parameters(model)
    return Probe(model, out_dir, rank, world_size, full, source).install()


def merge_traces(out: str, paths: list) -> dict:
    """One trace from the ranks' traces of one forward: whole stages from the first rank (a
    replicated stage whose hash differs on another rank is listed in `producer.disagree`, with
    that rank's statistics),
    every rank's part of the split stages; tensor files copied as `rank{r}.FILE`."""
    parts = []
    for p in paths:
        with open(os.path.join(p, MANIFEST)) as f:
            parts.append((p, json.load(f)))
    if not parts:
        raise ValueError("merge-trace: no rank traces given")
    head = parts[0][1]
    for p, m in parts:
        for key in ("tokens", "tp", "dtype"):
            if m[key] != head[key]:
                raise ValueError(f"{p}: {key} differs from {parts[0][0]}'s")
    os.makedirs(out, exist_ok=True)
    if os.listdir(out):
        raise FileExistsError(f"{out} already holds files; give the trace a new name")
    ranks = {m["producer"].get("rank", i): (p, m) for i, (p, m) in enumerate(parts)}
    if sorted(ranks) != list(range(head["tp"])):
        raise ValueError(f"merge-trace: ranks {sorted(ranks)} for tp {head['tp']}")
    by_rank = {r: {(s["name"], s.get("rank")): s for s in m["stages"]} for r, (_, m) in ranks.items()}
    stages, disagree = [], []

    def copy(r, s):
        s = dict(s)
        if "file" in s:
            name = f"rank{r}.{s['file']}"
            dst = os.path.join(out, name)
            if not os.path.exists(dst):
                shutil.copyfile(os.path.join(ranks[r][0], s["file"]), dst)
            s["file"] = name
        return s

    names = [(s["name"], s.get("rank")) for s in ranks[0][1]["stages"]]
    for name, rank in names:
        if rank is None:
            first = by_rank[0][(name, None)]
            stages.append(copy(0, first))
            for r in range(1, head["tp"]):
                other = by_rank[r].get((name, None))
                if other is None:
                    raise ValueError(f"{ranks[r][0]}: no stage {name}")
                if other["stats"]["hash"] != first["stats"]["hash"]:
                    # The rank's statistics say by how much: a reduction summed in another
                    # order on each rank differs by rounding, a missing one by the sum.
                    disagree.append({"stage": name, "rank": r, "stats": other["stats"]})
        else:
            for r in range(head["tp"]):
                s = by_rank[r].get((name, r))
                if s is None:
                    raise ValueError(f"{ranks[r][0]}: no rank {r} part of stage {name}")
                stages.append(copy(r, s))
    producer = {**head["producer"], "ranks": head["tp"], "disagree": disagree}
    producer.pop("rank", None)
    merged = {**head, "producer": producer, "stages": stages}
    _write_json(os.path.join(out, MANIFEST), merged)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description="merge the per-rank outputs of the vLLM probe")
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("merge-trace", help="one trace from the ranks' rank{r}.trace folders")
    t.add_argument("out")
    t.add_argument("parts", nargs="+")
    s = sub.add_parser("merge-shards", help="one shard manifest from the ranks' files")
    s.add_argument("out")
    s.add_argument("parts", nargs="+")
    args = parser.parse_args()
    if args.what == "merge-trace":
        m = merge_traces(args.out, args.parts)
        print(f"wrote {args.out}: {len(m['stages'])} stage records from {m['tp']} ranks, "
              f"{len(m['producer']['disagree'])} replicated stages differing across ranks")
    else:
        m = merge_shard_manifests(args.out, args.parts)
        print(f"wrote {args.out}: {sum(len(r['weights']) for r in m['ranks'])} shards "
              f"on {len(m['ranks'])} ranks")


if __name__ == "__main__":
    main()
