"""Record the docs/design.md §4 stages of a Hugging Face `GlmMoeDsaForCausalLM` forward as a glmcheck trace.

Usage: python -m glmcheck_probe.transformers_probe MODEL_DIR --tokens 1,2,3 --out run.trace
       [--full GLOB ...] [--dtype f32|bf16|f16]
       torchrun --nproc-per-node N -m glmcheck_probe.transformers_probe MODEL_DIR --tp-plan auto ...

The model is loaded in float32 (or `--dtype`) and run once on the prompt. Values are taken by
forward hooks on transformers' own modules (and, for the rotated RoPE parts, a wrapper around
the module's `apply_rotary_pos_emb_interleave` installed only during the forward), so the
computation is exactly the one `model(ids)` does.

With `--tp-plan auto` (under torchrun) every rank loads the model sharded by transformers' own
tensor-parallel plan. Stages held whole on every rank (replicated, or after the plan's all-reduce
or gather) are recorded whole; stages that hold only this rank's attention heads (`attn.q`,
`attn.kv`, `attn.q_rope`, `attn.ctx`) are recorded as rank parts. Each rank writes
`OUT.ranks/rank{r}.trace`; rank 0 then merges them into `OUT` and removes `OUT.ranks`.
"""

import argparse
import contextlib
import json
import os
import re
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

from .trace import DEFAULT_FULL, TraceWriter, fingerprint
from .vllm_probe import merge_traces

# The docs/design.md §4 dims spec of every stage this probe records, by name without its `L{n}.`.
DIMS = {
    "embed": "t d", "final_norm": "t d", "logits": "t v(tp)",
    "attn_norm": "t d", "attn.q_a": "t d", "attn.q_a_norm": "t d", "attn.q": "t h(tp) d",
    "attn.kv_a": "t d", "attn.kv_a_norm": "t d", "attn.kv": "t h(tp) d",
    "attn.q_rope": "t h(tp) d", "attn.k_rope": "t d", "attn.index_topk": "t k",
    "attn.ctx": "t h(tp) d", "attn.out": "t d", "attn_resid": "t d", "ffn_norm": "t d",
    "moe.router_logits": "t e", "moe.topk_ids": "t k", "moe.topk_weights": "t k",
    "moe.routed": "t d partial(tp)", "moe.shared": "t d partial(tp)",
    "ffn.out": "t d", "out": "t d",
}
LAYER_PREFIX = re.compile(r"^L[0-9]+\.")


def pair_order(x: torch.Tensor) -> torch.Tensor:
    """HF's rotated RoPE part (evens then odds) in pair order (x0, x1, x2, …), as llama.cpp and
    vLLM hold it, so the tensors compare element for element."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)


def head_split(numel: int, tokens: int, heads: int, width: int, tp: int, rank: int):
    """How a tensor of `numel` values holding attention heads of `width` values each was
    recorded: `(heads held, rank)`, where rank is None for all `heads` (whole) and this rank's
    number for a contiguous 1/tp of them (a `h(tp)` part). Anything else raises."""
    per_token = tokens * width
    if per_token == 0 or numel % per_token:
        raise ValueError(f"{numel} values are not {tokens} tokens of whole {width}-wide heads")
    held = numel // per_token
    if held == heads:
        return held, None
    if tp > 1 and heads % tp == 0 and held == heads // tp:
        return held, rank
    raise ValueError(f"{held} heads of {width} per token: neither all {heads} nor 1/{tp} of them")


def stage_dims(name: str, tp: int) -> str:
    """The dims spec of stage `name` as recorded whole. At tp > 1 a `partial(tp)` stage is held
    after its all-reduce (transformers reduces inside the module it hooks), so it is `t d`."""
    dims = DIMS[LAYER_PREFIX.sub("", name)]
    return "t d" if tp > 1 and dims.endswith("partial(tp)") else dims


class Recorder:
    """Turns hooked tensors into trace stages; knows the layer in progress for the RoPE wrapper.
    At `tp` > 1, head-split stages may hold this `rank`'s heads only (see `head_split`)."""

    def __init__(self, writer: TraceWriter, tokens: int, heads: int, rank: int = 0, tp: int = 1):
        self.writer, self.tokens, self.heads = writer, tokens, heads
        self.rank, self.tp = rank, tp
        self.layer = None

    def take(self, name: str, tensor: torch.Tensor, *tail: int) -> None:
        """Record `tensor` (batch of one) as stage `name` of shape [T, *tail]."""
        x = tensor.detach().cpu()
        x = x.to(torch.float32) if x.is_floating_point() else x.to(torch.int32)
        x = x.reshape(self.tokens, *tail).numpy()
        self.writer.record(name, x, stage_dims(name, self.tp))

    def take_heads(self, name: str, tensor: torch.Tensor, width: int) -> None:
        """Record `tensor` as stage `name` [T, heads, width]: whole, or this rank's part."""
        held, rank = head_split(tensor.numel(), self.tokens, self.heads, width, self.tp, self.rank)
        x = tensor.detach().cpu().to(torch.float32).reshape(self.tokens, held, width).numpy()
        self.writer.record(name, x, DIMS[LAYER_PREFIX.sub("", name)], rank)

    def index_topk(self, name: str, ids: torch.Tensor) -> None:
        """DSA selections, with causally masked picks (key after the query) written as -1."""
        ids = ids.detach().cpu().reshape(self.tokens, -1).to(torch.int64)
        query = torch.arange(self.tokens).unsqueeze(-1)
        self.take(name, torch.where(ids > query, -1, ids), -1)


def _on_output(module, fn):
    return module.register_forward_hook(lambda _m, _inputs, output: fn(output))


def _on_input(module, fn):
    return module.register_forward_pre_hook(lambda _m, inputs: fn(inputs[0]))


def _layer_hooks(rec: Recorder, n: int, layer) -> list:
    """Hooks for the stages of decoder layer `n`, registered in the order they fire."""
    at, attn = f"L{n}.", layer.self_attn
    take = lambda stage, *tail: lambda t: rec.take(at + stage, t, *tail)  # noqa: E731
    heads = lambda stage, width: lambda t: rec.take_heads(at + stage, t, width)  # noqa: E731
    qk, v = attn.qk_nope_head_dim + attn.qk_rope_head_dim, attn.v_head_dim
    hooks = [
        layer.register_forward_pre_hook(lambda _m, _i: setattr(rec, "layer", n)),
        _on_output(layer.input_layernorm, take("attn_norm", -1)),
        _on_output(attn.q_a_proj, take("attn.q_a", -1)),
        _on_output(attn.q_a_layernorm, take("attn.q_a_norm", -1)),
        _on_output(attn.q_b_proj, heads("attn.q", qk)),
        _on_output(attn.kv_a_proj_with_mqa, take("attn.kv_a", -1)),
        _on_output(attn.kv_a_layernorm, take("attn.kv_a_norm", -1)),
        _on_output(attn.kv_b_proj, heads("attn.kv", attn.qk_nope_head_dim + v)),
        _on_input(attn.o_proj, heads("attn.ctx", v)),
        _on_output(attn.o_proj, take("attn.out", -1)),
        _on_output(attn, lambda out: rec.index_topk(at + "attn.index_topk", out[2])),
        _on_input(layer.post_attention_layernorm, take("attn_resid", -1)),
        _on_output(layer.post_attention_layernorm, take("ffn_norm", -1)),
    ]
    if isinstance(layer.mlp, hf.GlmMoeDsaMoE):
        moe = layer.mlp

        def gate(out):
            logits, weights, ids = out
            rec.take(at + "moe.router_logits", logits, -1)
            rec.take(at + "moe.topk_ids", ids, -1)
            rec.take(at + "moe.topk_weights", weights, -1)

        hooks += [
            _on_output(moe.gate, gate),
            _on_output(moe.experts, take("moe.routed", -1)),
            _on_output(moe.shared_experts, take("moe.shared", -1)),
        ]
    hooks += [
        _on_output(layer.mlp, take("ffn.out", -1)),
        _on_output(layer, lambda out: rec.take(at + "out", out[0], -1)),
    ]
    return hooks


@contextlib.contextmanager
def _recording_rope(rec: Recorder):
    """Wrap the module's interleaved RoPE for one forward: the rotated parts are not any
    module's output. The MLA call is told apart from the indexer's by `unsqueeze_dim` (1 vs 2)."""
    original = hf.apply_rotary_pos_emb_interleave

    def wrapped(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        q_embed, k_embed = original(q, k, cos, sin, position_ids, unsqueeze_dim)
        if unsqueeze_dim == 1:
            # [B, heads, T, rope] and [B, 1, T, rope] → token-major, pair order.
            rope = q_embed.shape[-1]
            rec.take_heads(f"L{rec.layer}.attn.q_rope", pair_order(q_embed.transpose(1, 2)), rope)
            rec.take(f"L{rec.layer}.attn.k_rope", pair_order(k_embed.transpose(1, 2)), -1)
        return q_embed, k_embed

    hf.apply_rotary_pos_emb_interleave = wrapped
    try:
        yield
    finally:
        hf.apply_rotary_pos_emb_interleave = original


def _hooks(rec: Recorder, model) -> list:
    inner = model.model
    hooks = [_on_output(inner.embed_tokens, lambda t: rec.take("embed", t, -1))]
    for n, layer in enumerate(inner.layers[: model.config.num_hidden_layers]):
        hooks += _layer_hooks(rec, n, layer)
    return hooks + [
        _on_output(inner.norm, lambda t: rec.take("final_norm", t, -1)),
        _on_output(model.lm_head, lambda t: rec.take("logits", t, -1)),
    ]


# The dtypes a probe can run the model in, by their trace names.
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def header(model_dir: str, tokens: list, dtype: str = "f32") -> dict:
    """The run-wide manifest fields."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return {
        "producer": {"name": "glmcheck_probe", "transformers": transformers.__version__,
                     "torch": torch.__version__, "argv": sys.argv},
        "model": {"source": model_dir, "config": config,
                  "fingerprint": fingerprint(model_dir, config)},
        "tokens": tokens, "backend": "transformers", "dtype": dtype, "tp": 1,
    }


def probe(model_dir: str, tokens: list, out: str, full=DEFAULT_FULL, dtype: str = "f32",
          tp_plan: str = None) -> dict:
    """Run the model at `dtype` on `tokens` and write the trace `out` (values as float32);
    the manifest as written. With `tp_plan` (under torchrun) the model is sharded by
    transformers' plan and every rank must call this; see `record`."""
    if tp_plan is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
        return record(model.eval(), model_dir, tokens, out, full, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], tp_plan=tp_plan)
    import torch.distributed as dist
    return record(model.eval(), model_dir, tokens, out, full, dtype,
                  rank=dist.get_rank(), tp=dist.get_world_size(), barrier=dist.barrier,
                  notes={"tp_plan": tp_plan})


def rank_dir(out: str) -> str:
    """Where the ranks' own traces of a TP run go before rank 0 merges them into `out`."""
    return os.path.normpath(out) + ".ranks"


def record(model, model_dir: str, tokens: list, out: str, full=DEFAULT_FULL, dtype: str = "f32",
           rank: int = 0, tp: int = 1, barrier=None, notes=None) -> dict:
    """Record one forward of the loaded `model` on `tokens` into the trace `out`; the manifest
    as written (at tp > 1: the merged one on rank 0, this rank's own elsewhere).

    At `tp` > 1 every rank calls this with its `rank` and a `barrier` over all ranks: each
    writes `rank_dir(out)/rank{r}.trace`, then rank 0 merges them into `out` (whole stages from
    rank 0, replicated stages whose hash differs on another rank listed in
    `producer.disagree`, every rank's part of split stages) and removes `rank_dir(out)`."""
    if not isinstance(model, hf.GlmMoeDsaForCausalLM):
        raise TypeError(f"{model_dir} loads as {type(model).__name__}, not GlmMoeDsaForCausalLM")
    head = header(model_dir, tokens, dtype)
    path = out
    if tp > 1:
        if rank == 0 and os.path.isdir(out) and os.listdir(out):
            raise FileExistsError(f"{out} already holds files; give the trace a new name")
        head["tp"] = tp
        head["producer"].update(notes or {}, rank=rank, world_size=tp)
        path = os.path.join(rank_dir(out), f"rank{rank}.trace")
    writer = TraceWriter(path, head, full)
    rec = Recorder(writer, len(tokens), model.config.num_attention_heads, rank, tp)
    hooks = _hooks(rec, model)
    ids = torch.tensor([tokens])
    if tp > 1:
        ids = ids.to(model.device)
    try:
        with torch.no_grad(), _recording_rope(rec):
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    manifest = writer.finish()
    if tp == 1:
        return manifest
    barrier()
    if rank == 0:
        parts = [os.path.join(rank_dir(out), f"rank{r}.trace") for r in range(tp)]
        manifest = merge_traces(out, parts)
        shutil.rmtree(rank_dir(out))
        for d in manifest["producer"]["disagree"]:
            print(f"glmcheck_probe: replicated stage {d['stage']} differs on rank {d['rank']}",
                  file=sys.stderr)
    barrier()
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="Hugging Face folder of a GlmMoeDsaForCausalLM")
    parser.add_argument("--tokens", required=True, help="prompt token ids, comma-separated")
    parser.add_argument("--out", required=True, help="trace folder to create (absent or empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32",
                        help="the dtype the model runs in (stages are stored as float32)")
    parser.add_argument("--full", action="append",
                        help="stages kept in full (glob; repeatable); default: logits, L*.out")
    parser.add_argument("--tp-plan", choices=["auto"],
                        help="shard the model by transformers' tensor-parallel plan "
                             "(run under torchrun, one process per GPU)")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    manifest = probe(args.model_dir, tokens, args.out, args.full or DEFAULT_FULL, args.dtype,
                     args.tp_plan)
    if manifest["tp"] > 1 and manifest["producer"].get("rank", 0) != 0:
        import torch.distributed as dist
        dist.destroy_process_group()
        return
    kept = sum("file" in s for s in manifest["stages"])
    at = f", tp {manifest['tp']}" if manifest["tp"] > 1 else ""
    print(f"wrote {args.out}: {len(manifest['stages'])} stages, {kept} in full{at}")
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
