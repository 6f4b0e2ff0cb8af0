"""A stand-in for vLLM's GLM-5 model on CPU, to test the vLLM probe without vLLM.

Module trees carry vLLM's module paths, class names (`VocabParallelEmbedding`,
`DeepSeekV2FusedQkvAProjLinear`, `ColumnParallelLinear`, `RowParallelLinear`, `GateLinear`,
`FusedMoE` with stacked `w13_weight` / `w2_weight`, `ParallelLMHead`, `LogitsProcessor`, …) and
parameter names, with each rank's shard of a Hugging Face GLM-5 folder cut as vLLM's loaders cut
it (whole heads of q_b / kv_b, RowParallel inputs, gate/up halves per part, experts along their
intermediate dimension, vocab rows). Each rank runs in its own thread; all-reduce and all-gather
add or join the ranks' tensors in rank order. The forward follows vLLM's structure: fused
(normed, residual) RMSNorms, `(output, bias)` from the linear layers, interleaved RoPE in pair
order, the DSA indexer with -1 for padding, sigmoid routing with the correction bias for the
choice only, `routed_scaling_factor` applied to the routed output, q_a / kv_a norms with
`rms_norm_eps`.

Usage: fake_vllm.py HF_DIR OUT_DIR --tp N [--tokens IDS] [--fault unshard-kv-b|whole-kv-b]
       [--rename-class OLD=NEW] [--rename-module OLD=NEW] [--no-forward]

Writes OUT_DIR/parts/ (per-rank outputs of the probe), OUT_DIR/shards.json (merged manifest)
and, unless --no-forward, OUT_DIR/run.trace (merged trace). Faults: `unshard-kv-b`, every rank
holds rank 0's block of each kv_b_proj; `whole-kv-b`, every rank holds kv_b_proj whole (its
forward cannot run then: use --no-forward).
"""

import argparse
import json
import math
import os
import sys
import threading

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "probes"))
from glmcheck_probe import vllm_probe  # noqa: E402


class Group:
    """The ranks' collectives, in one process: sums and joins in rank order."""

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size)

    def _exchange(self, rank, x):
        self.slots[rank] = x
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def all_reduce(self, rank, x):
        parts = self._exchange(rank, x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return total

    def all_gather(self, rank, x, dim):
        return torch.cat(self._exchange(rank, x), dim=dim)


class Parallel(nn.Module):
    def __init__(self, ctx):
        super().__init__()
        self.tp_rank, self.tp_size = ctx.rank, ctx.size
        self.ctx = [ctx]  # not a submodule


def _param(t):
    return nn.Parameter(t.contiguous(), requires_grad=False)


class LinearBase(Parallel):
    def __init__(self, ctx, weight, reduce_results=True):
        super().__init__(ctx)
        self.weight = _param(weight)
        self.reduce_results = reduce_results

    def forward(self, x):
        return F.linear(x, self.weight), None


class ReplicatedLinear(LinearBase):
    pass


class GateLinear(ReplicatedLinear):
    def forward(self, x):
        return F.linear(x.float(), self.weight.float()), None


class ColumnParallelLinear(LinearBase):
    pass


class MergedColumnParallelLinear(ColumnParallelLinear):
    pass


class DeepSeekV2FusedQkvAProjLinear(MergedColumnParallelLinear):
    pass


class RowParallelLinear(LinearBase):
    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.reduce_results and self.tp_size > 1:
            y = self.ctx[0].group.all_reduce(self.tp_rank, y)
        return y, None


class VocabParallelEmbedding(Parallel):
    def __init__(self, ctx, weight):
        super().__init__(ctx)
        self.weight = _param(weight)

    def forward(self, ids):
        rows = self.weight.shape[0]
        start = self.tp_rank * rows
        local = ids - start
        inside = (local >= 0) & (local < rows)
        out = self.weight[local.clamp(0, rows - 1)] * inside.unsqueeze(-1)
        return self.ctx[0].group.all_reduce(self.tp_rank, out) if self.tp_size > 1 else out


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, _x):
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor")


class LogitsProcessor(Parallel):
    def forward(self, lm_head, hidden):
        local = F.linear(hidden, lm_head.weight)
        return self.ctx[0].group.all_gather(self.tp_rank, local, -1) if self.tp_size > 1 else local


class RMSNorm(nn.Module):
    def __init__(self, weight, eps):
        super().__init__()
        self.weight, self.eps = _param(weight), eps

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
            residual = x
        out = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        return out if residual is None else (out, residual)


class LayerNorm(nn.Module):
    def __init__(self, weight, bias, eps):
        super().__init__()
        self.weight, self.bias, self.eps = _param(weight), _param(bias), eps

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class RotaryEmbedding(nn.Module):
    """Interleaved (GPT-J) RoPE on the last `rotary_dim` values, pairs (x0, x1), (x2, x3)…"""

    def __init__(self, rotary_dim, theta):
        super().__init__()
        self.rotary_dim, self.is_neox_style = rotary_dim, False
        self.inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)

    def _rotate(self, positions, x):
        angle = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq  # [T, rope/2]
        shape = [angle.shape[0]] + [1] * (x.dim() - 2) + [angle.shape[1]]
        cos, sin = angle.cos().float().view(shape), angle.sin().float().view(shape)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)

    def forward(self, positions, q, k):
        return self._rotate(positions, q), self._rotate(positions, k)


class Indexer(nn.Module):
    def __init__(self, cfg, w):
        super().__init__()
        self.n_head, self.head_dim = cfg["index_n_heads"], cfg["index_head_dim"]
        self.rope_dim, self.topk = cfg["qk_rope_head_dim"], cfg["index_topk"]
        self.wq_b = ReplicatedLinear(w.ctx, w("indexer.wq_b.weight"))
        self.wk_weights_proj = MergedColumnParallelLinear(
            w.ctx, torch.cat([w("indexer.wk.weight"), w("indexer.weights_proj.weight")]))
        self.k_norm = LayerNorm(w("indexer.k_norm.weight"), w("indexer.k_norm.bias"), 1e-6)

    def forward(self, hidden, qr, positions, rotary_emb):
        T, D, r = hidden.shape[0], self.head_dim, self.rope_dim
        q = self.wq_b(qr)[0].view(T, self.n_head, D)
        kw = self.wk_weights_proj(hidden)[0]
        k, weights = self.k_norm(kw[:, :D]), kw[:, D:]
        q_pe, k_pe = rotary_emb(positions, q[..., :r], k[:, :r].unsqueeze(1))
        q = torch.cat([q_pe, q[..., r:]], dim=-1)
        k = torch.cat([k_pe.reshape(T, r), k[:, r:]], dim=-1)
        scores = F.relu(torch.einsum("thd,sd->ths", q, k) * D ** -0.5)
        index = torch.einsum("th,ths->ts", weights * self.n_head ** -0.5, scores)
        causal = torch.arange(T).unsqueeze(0) <= torch.arange(T).unsqueeze(1)
        index = index.masked_fill(~causal, float("-inf"))
        top = index.topk(min(self.topk, T), dim=-1)
        return torch.where(torch.isinf(top.values), -1, top.indices).to(torch.int32)


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, cfg, w, rope):
        super().__init__()
        heads = cfg["num_attention_heads"] // w.ctx.size
        self.heads, self.nope = heads, cfg["qk_nope_head_dim"]
        self.rope, self.v = cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.q_lora, self.kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        eps = cfg["rms_norm_eps"]
        self.fused_qkv_a_proj = DeepSeekV2FusedQkvAProjLinear(
            w.ctx, torch.cat([w("q_a_proj.weight"), w("kv_a_proj_with_mqa.weight")]))
        self.q_a_layernorm = RMSNorm(w("q_a_layernorm.weight"), eps)
        self.q_b_proj = ColumnParallelLinear(w.ctx, w.rows("q_b_proj.weight"))
        self.kv_a_layernorm = RMSNorm(w("kv_a_layernorm.weight"), eps)
        self.kv_b_proj = ColumnParallelLinear(w.ctx, w.kv_b())
        self.o_proj = RowParallelLinear(w.ctx, w.cols("o_proj.weight"))
        self.rotary_emb = rope
        self.indexer = Indexer(cfg, w)
        self.scaling = (self.nope + self.rope) ** -0.5

    def forward(self, positions, hidden):
        T = hidden.shape[0]
        qkv = self.fused_qkv_a_proj(hidden)[0]
        q_c = self.q_a_layernorm(qkv[:, : self.q_lora])
        q = self.q_b_proj(q_c)[0].view(T, self.heads, self.nope + self.rope)
        kv_c, k_pe = qkv[:, self.q_lora: self.q_lora + self.kv_lora], qkv[:, self.q_lora + self.kv_lora:]
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c))[0].view(T, self.heads, self.nope + self.v)
        q_pe, k_pe = self.rotary_emb(positions, q[..., self.nope:], k_pe.unsqueeze(1))
        keys = self.indexer(hidden, q_c, positions, self.rotary_emb)
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1)
        k = torch.cat([kv[..., : self.nope], k_pe.expand(T, self.heads, self.rope)], dim=-1)
        # Selected keys (-1 selects none) at or before the query.
        allowed = (keys.unsqueeze(-1) == torch.arange(T)).any(1)
        allowed &= torch.arange(T).unsqueeze(0) <= torch.arange(T).unsqueeze(1)
        scores = torch.einsum("thd,shd->hts", q, k) * self.scaling
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        ctx = torch.einsum("hts,shd->thd", probs, kv[..., self.nope:])
        return self.o_proj(ctx.reshape(T, self.heads * self.v))[0]


def silu_and_mul(x):
    g, u = x.chunk(2, dim=-1)
    return F.silu(g) * u


class DeepseekV2MLP(nn.Module):
    def __init__(self, w, prefix, reduce_results=True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            w.ctx, torch.cat([w.rows(f"{prefix}.gate_proj.weight"), w.rows(f"{prefix}.up_proj.weight")]))
        self.down_proj = RowParallelLinear(w.ctx, w.cols(f"{prefix}.down_proj.weight"), reduce_results)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)[0]))[0]


class FusedMoE(Parallel):
    """Experts stacked as vLLM holds them: w13 [E, 2·I/tp, H] (gate then up), w2 [E, H, I/tp]."""

    def __init__(self, cfg, w):
        super().__init__(w.ctx)
        E = cfg["n_routed_experts"]
        self.w13_weight = _param(torch.stack([
            torch.cat([w.rows(f"mlp.experts.{e}.gate_proj.weight"), w.rows(f"mlp.experts.{e}.up_proj.weight")])
            for e in range(E)]))
        self.w2_weight = _param(torch.stack([w.cols(f"mlp.experts.{e}.down_proj.weight") for e in range(E)]))
        self.top_k, self.groups = cfg["num_experts_per_tok"], cfg["n_group"]
        self.topk_group, self.renormalize = cfg["topk_group"], cfg["norm_topk_prob"]
        self.e_score_correction_bias = None

    def forward(self, hidden_states, router_logits):
        scores = router_logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        T, E = choice.shape
        grouped = choice.view(T, self.groups, E // self.groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // self.groups, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        out = torch.zeros_like(hidden_states)
        for t in range(T):
            for j in range(self.top_k):
                e = int(ids[t, j])
                h = silu_and_mul(F.linear(hidden_states[t], self.w13_weight[e]))
                out[t] += weights[t, j] * F.linear(h, self.w2_weight[e])
        return out


class DeepseekV2MoE(Parallel):
    def __init__(self, cfg, w):
        super().__init__(w.ctx)
        self.routed_scaling_factor = cfg["routed_scaling_factor"]
        self.gate = GateLinear(w.ctx, w("mlp.gate.weight"))
        self.gate.e_score_correction_bias = _param(w("mlp.gate.e_score_correction_bias"))
        self.shared_experts = DeepseekV2MLP(w, "mlp.shared_experts", reduce_results=False)
        self.experts = FusedMoE(cfg, w)
        self.experts.e_score_correction_bias = self.gate.e_score_correction_bias

    def forward(self, x):
        router_logits = self.gate(x)[0]
        shared = self.shared_experts(x)
        routed = self.experts(hidden_states=x, router_logits=router_logits)
        out = routed * self.routed_scaling_factor + shared
        return self.ctx[0].group.all_reduce(self.tp_rank, out) if self.tp_size > 1 else out


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, cfg, w, rope, n):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.self_attn = DeepseekV2MLAAttention(cfg, w, rope)
        moe = n >= cfg["first_k_dense_replace"]
        self.mlp = DeepseekV2MoE(cfg, w) if moe else DeepseekV2MLP(w, "mlp")
        self.input_layernorm = RMSNorm(w("input_layernorm.weight"), eps)
        self.post_attention_layernorm = RMSNorm(w("post_attention_layernorm.weight"), eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV2Model(nn.Module):
    def __init__(self, cfg, w):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(w.ctx, w.vocab("model.embed_tokens.weight"))
        rope = RotaryEmbedding(cfg["qk_rope_head_dim"], cfg["rope_parameters"]["rope_theta"])
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(cfg, w.layer(n), rope, n) for n in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(w("model.norm.weight"), cfg["rms_norm_eps"])

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden, residual)[0]


class GlmMoeDsaForCausalLM(nn.Module):
    def __init__(self, cfg, w):
        super().__init__()
        self.config = Config(cfg)
        self.model = DeepseekV2Model(self.config, w)
        self.lm_head = ParallelLMHead(w.ctx, w.vocab("lm_head.weight"))
        self.logits_processor = LogitsProcessor(w.ctx)

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def compute_logits(self, hidden):
        return self.logits_processor(self.lm_head, hidden)


class Config(dict):
    """A dict with attribute access, as a config object is read."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError as e:
            raise AttributeError(k) from e

    def to_dict(self):
        return dict(self)


class Ctx:
    def __init__(self, rank, size, group):
        self.rank, self.size, self.group = rank, size, group


class Weights:
    """A rank's view of the checkpoint: whole tensors, or its block along an axis."""

    def __init__(self, tensors, ctx, fault, prefix=""):
        self.t, self.ctx, self.fault, self.prefix = tensors, ctx, fault, prefix

    def layer(self, n):
        return Weights(self.t, self.ctx, self.fault, f"model.layers.{n}.")

    def _get(self, name):
        for key in (self.prefix + name, self.prefix + "self_attn." + name, name):
            if key in self.t:
                return self.t[key]
        raise KeyError(f"{self.prefix}{name}: not in the checkpoint")

    def __call__(self, name):
        return self._get(name)

    def _block(self, x, axis, rank=None):
        rank = self.ctx.rank if rank is None else rank
        return x.chunk(self.ctx.size, dim=axis)[rank]

    def rows(self, name):
        return self._block(self._get(name), 0)

    def cols(self, name):
        return self._block(self._get(name), 1)

    def vocab(self, name):
        return self.rows(name)

    def kv_b(self):
        whole = self._get("kv_b_proj.weight")
        if self.fault == "whole-kv-b":
            return whole
        return self._block(whole, 0, 0 if self.fault == "unshard-kv-b" else None)


def rename(model, classes, modules):
    """A renamed vLLM: classes given new names, submodules moved to new attribute names."""
    for old, new in classes:
        for m in model.modules():
            if type(m).__name__ == old:
                m.__class__ = type(new, (type(m),), {})
    for old, new in modules:
        for m in list(model.modules()):
            if old in m._modules:
                m._modules[new] = m._modules.pop(old)


def run_rank(rank, args, cfg, tensors, group, errors):
    try:
        ctx = Ctx(rank, args.tp, group)
        model = GlmMoeDsaForCausalLM(cfg, Weights(tensors, ctx, args.fault)).eval()
        rename(model, args.rename_class, args.rename_module)
        parts = os.path.join(args.out_dir, "parts")
        vllm_probe.write_shard_manifest(model, os.path.join(parts, f"shards.rank{rank}.json"),
                                        rank, args.tp)
        if args.no_forward:
            return
        probe = vllm_probe.install(model, parts, rank, args.tp, full=("**",), source=args.hf)
        ids = torch.tensor(args.tokens)
        with torch.no_grad():
            hidden = model(ids, torch.arange(len(args.tokens)))
            model.compute_logits(hidden)
        probe.finish()
    except BaseException as e:  # reported by the main thread
        errors[rank] = e
        group.barrier.abort()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf")
    ap.add_argument("out_dir")
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--tokens", default="1,5,9,13")
    ap.add_argument("--fault", choices=["unshard-kv-b", "whole-kv-b"])
    ap.add_argument("--rename-class", action="append", default=[], type=lambda s: s.split("=", 1))
    ap.add_argument("--rename-module", action="append", default=[], type=lambda s: s.split("=", 1))
    ap.add_argument("--no-forward", action="store_true")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    torch.set_num_threads(1)
    with open(os.path.join(args.hf, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(args.hf, "model.safetensors"))
    os.makedirs(os.path.join(args.out_dir, "parts"), exist_ok=True)
    group, errors = Group(args.tp), {}
    threads = [threading.Thread(target=run_rank, args=(r, args, cfg, tensors, group, errors))
               for r in range(args.tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in sorted(errors):
        e = errors[rank]
        if not isinstance(e, threading.BrokenBarrierError):
            print(f"rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
    parts = os.path.join(args.out_dir, "parts")
    vllm_probe.merge_shard_manifests(
        os.path.join(args.out_dir, "shards.json"),
        [os.path.join(parts, f"shards.rank{r}.json") for r in range(args.tp)])
    if not args.no_forward:
        vllm_probe.merge_traces(os.path.join(args.out_dir, "run.trace"),
                                [os.path.join(parts, f"rank{r}.trace") for r in range(args.tp)])


if __name__ == "__main__":
    main()
