"""Record the DESIGN §4 stages of a Hugging Face `GlmMoeDsaForCausalLM` forward as a glmcheck trace.

Usage: python -m glmcheck_probe.transformers_probe MODEL_DIR --tokens 1,2,3 --out run.trace
       [--full GLOB ...]

The model is loaded in float32 and run once on the prompt. Values are taken by forward hooks on
transformers' own modules (and, for the rotated RoPE parts, a wrapper around the module's
`apply_rotary_pos_emb_interleave` installed only during the forward), so the computation is
exactly the one `model(ids)` does.
"""

import argparse
import contextlib
import json
import os
import re
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

from .trace import DEFAULT_FULL, TraceWriter, fingerprint

# The DESIGN §4 dims spec of every stage this probe records, by name without its `L{n}.`.
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


class Recorder:
    """Turns hooked tensors into trace stages; knows the layer in progress for the RoPE wrapper."""

    def __init__(self, writer: TraceWriter, tokens: int, heads: int):
        self.writer, self.tokens, self.heads = writer, tokens, heads
        self.layer = None

    def take(self, name: str, tensor: torch.Tensor, *tail: int) -> None:
        """Record `tensor` (batch of one) as stage `name` of shape [T, *tail]."""
        x = tensor.detach().cpu()
        x = x.to(torch.float32) if x.is_floating_point() else x.to(torch.int32)
        x = x.reshape(self.tokens, *tail).numpy()
        self.writer.record(name, x, DIMS[LAYER_PREFIX.sub("", name)])

    def index_topk(self, name: str, ids: torch.Tensor) -> None:
        """DSA selections, with causally masked picks (key after the query) written as -1."""
        ids = ids.reshape(self.tokens, -1).to(torch.int64)
        query = torch.arange(self.tokens).unsqueeze(-1)
        self.take(name, torch.where(ids > query, -1, ids), -1)


def _on_output(module, fn):
    return module.register_forward_hook(lambda _m, _inputs, output: fn(output))


def _on_input(module, fn):
    return module.register_forward_pre_hook(lambda _m, inputs: fn(inputs[0]))


def _layer_hooks(rec: Recorder, n: int, layer) -> list:
    """Hooks for the stages of decoder layer `n`, registered in the order they fire."""
    at, attn, h = f"L{n}.", layer.self_attn, rec.heads
    take = lambda stage, *tail: lambda t: rec.take(at + stage, t, *tail)  # noqa: E731
    hooks = [
        layer.register_forward_pre_hook(lambda _m, _i: setattr(rec, "layer", n)),
        _on_output(layer.input_layernorm, take("attn_norm", -1)),
        _on_output(attn.q_a_proj, take("attn.q_a", -1)),
        _on_output(attn.q_a_layernorm, take("attn.q_a_norm", -1)),
        _on_output(attn.q_b_proj, take("attn.q", h, -1)),
        _on_output(attn.kv_a_proj_with_mqa, take("attn.kv_a", -1)),
        _on_output(attn.kv_a_layernorm, take("attn.kv_a_norm", -1)),
        _on_output(attn.kv_b_proj, take("attn.kv", h, -1)),
        _on_input(attn.o_proj, take("attn.ctx", h, -1)),
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
            rec.take(f"L{rec.layer}.attn.q_rope", pair_order(q_embed.transpose(1, 2)), rec.heads, -1)
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


def probe(model_dir: str, tokens: list, out: str, full=DEFAULT_FULL, dtype: str = "f32") -> dict:
    """Run the model at `dtype` on `tokens` and write the trace `out` (values as float32);
    the manifest as written."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    if not isinstance(model, hf.GlmMoeDsaForCausalLM):
        raise TypeError(f"{model_dir} loads as {type(model).__name__}, not GlmMoeDsaForCausalLM")
    writer = TraceWriter(out, header(model_dir, tokens, dtype), full)
    rec = Recorder(writer, len(tokens), model.config.num_attention_heads)
    hooks = _hooks(rec, model)
    try:
        with torch.no_grad(), _recording_rope(rec):
            model(torch.tensor([tokens]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return writer.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", help="Hugging Face folder of a GlmMoeDsaForCausalLM")
    parser.add_argument("--tokens", required=True, help="prompt token ids, comma-separated")
    parser.add_argument("--out", required=True, help="trace folder to create (absent or empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f32",
                        help="the dtype the model runs in (stages are stored as float32)")
    parser.add_argument("--full", action="append",
                        help="stages kept in full (glob; repeatable); default: logits, L*.out")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    manifest = probe(args.model_dir, tokens, args.out, args.full or DEFAULT_FULL, args.dtype)
    kept = sum("file" in s for s in manifest["stages"])
    print(f"wrote {args.out}: {len(manifest['stages'])} stages, {kept} in full")


if __name__ == "__main__":
    main()
