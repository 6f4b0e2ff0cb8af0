"""A Hugging Face GLM-5 folder (`glmcheck synth --format hf`, per-expert or fused experts,
FP8 block-scaled weights dequantized) read into one TP rank's shards the way SGLang 0.5.23's
loader lays them out (models/deepseek_common/deepseek_weight_loader.py and the parallel
layers' weight_loaders): q_a_proj and kv_a_proj_with_mqa concatenated into
fused_qkv_a_proj_with_mqa; q_b_proj, kv_b_proj and gate/up split by output rows (whole heads,
in rank order), o_proj and down_proj by input columns; embed_tokens and lm_head split by
vocabulary rows (padded to 64); norms, the indexer and the router replicated.
"""

import glob
import json
import os

import torch
from safetensors import safe_open

from glmcheck_oracle.sglang.layers import tp


def config(hf_dir: str) -> dict:
    """config.json with the fields the model reads filled as SGLang fills absent ones."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "glm_moe_dsa":
        raise SystemExit(f"{hf_dir}: model_type {cfg.get('model_type')!r}, not glm_moe_dsa")
    rope = cfg.get("rope_parameters") or {}
    if (rope.get("rope_type") or "default") != "default" or cfg.get("rope_scaling"):
        raise SystemExit(f"{hf_dir}: rope scaling {rope or cfg.get('rope_scaling')} is not "
                         "modelled by this fixture (only default RoPE)")
    cfg["rope_theta"] = rope.get("rope_theta", cfg.get("rope_theta"))
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise SystemExit(f"{hf_dir}: scoring_func {cfg['scoring_func']!r}; SGLang's "
                         "biased_grouped_topk scores with a sigmoid")
    n = cfg["num_hidden_layers"]
    cfg.setdefault("indexer_types", ["full"] * n)
    cfg.setdefault("n_group", 1)
    cfg.setdefault("topk_group", 1)
    cfg.setdefault("moe_layer_freq", 1)
    return cfg


class _Tensors:
    """Every tensor of the folder's safetensors files, by name, FP8 ones dequantized with
    their 128×128 `weight_scale_inv` blocks."""

    def __init__(self, hf_dir):
        self.files = {}
        for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
            handle = safe_open(path, "pt")
            for name in handle.keys():
                self.files[name] = handle

    def __contains__(self, name):
        return name in self.files

    def __getitem__(self, name):
        t = self.files[name].get_tensor(name)
        scale_name = name + "_scale_inv"
        if t.dtype == torch.float8_e4m3fn and scale_name in self.files:
            scale = self.files[scale_name].get_tensor(scale_name).float()
            scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
            t = t.float() * scale[: t.shape[0], : t.shape[1]]
        return t.float()


def _rows(t, part, parts):
    return t.chunk(parts, 0)[part]


def _cols(t, part, parts):
    return t.chunk(parts, -1)[part]


def _gate_up(gate, up, rank, size):
    """MergedColumnParallelLinear: this rank's rows of gate, then of up."""
    return torch.cat([_rows(gate, rank, size), _rows(up, rank, size)])


def load(hf_dir: str, cfg: dict, dtype, fault=None) -> dict:
    """This rank's weights, nested as the model's constructors take them."""
    rank, size = tp()
    t = _Tensors(hf_dir)

    def cast(x):
        return x.to(dtype)

    vocab = cfg["vocab_size"]
    padded = -(-vocab // 64) * 64
    if padded % size:
        raise SystemExit(f"vocabulary {vocab} (padded {padded}) does not split over TP {size}")
    per_rank = padded // size

    def vocab_rows(name):
        full = torch.zeros(padded, cfg["hidden_size"])
        full[:vocab] = t[name]
        return cast(full[rank * per_rank:(rank + 1) * per_rank])

    heads = cfg["num_attention_heads"]
    if heads % size:
        raise SystemExit(f"{heads} attention heads do not split over TP {size}")
    w = {"embed": vocab_rows("model.embed_tokens.weight"), "vocab_start": rank * per_rank,
         "lm_head": vocab_rows("lm_head.weight"), "norm": cast(t["model.norm.weight"]),
         "layers": []}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        q_b_part = size - 1 - rank if fault == "rank-order-q-b" else rank
        kv_b_part = 0 if fault == "unsharded-kv-b" else rank
        attn = {
            "fused_qkv_a": cast(torch.cat([t[a + "q_a_proj.weight"],
                                           t[a + "kv_a_proj_with_mqa.weight"]])),
            "q_a_layernorm": cast(t[a + "q_a_layernorm.weight"]),
            "q_b_proj": cast(_rows(t[a + "q_b_proj.weight"], q_b_part, size)),
            "kv_a_layernorm": cast(t[a + "kv_a_layernorm.weight"]),
            "kv_b_proj": cast(_rows(t[a + "kv_b_proj.weight"], kv_b_part, size)),
            "o_proj": cast(_cols(t[a + "o_proj.weight"], rank, size)),
            "indexer": None,
        }
        if cfg["indexer_types"][i] == "full":  # a "shared" layer has no indexer (dv2:2117)
            x = a + "indexer."
            attn["indexer"] = {k: cast(t[x + k + ".weight"])
                               for k in ("wq_b", "wk", "weights_proj")}
            attn["indexer"].update({"k_norm.weight": t[x + "k_norm.weight"],
                                    "k_norm.bias": t[x + "k_norm.bias"]})
        m = p + "mlp."
        sparse = (i >= cfg["first_k_dense_replace"] and i % cfg["moe_layer_freq"] == 0)
        if sparse:  # dv2:2784 _is_layer_sparse
            mlp = _moe(t, m, cfg, rank, size, cast)
        else:
            mlp = {"gate_up_proj": cast(_gate_up(t[m + "gate_proj.weight"],
                                                 t[m + "up_proj.weight"], rank, size)),
                   "down_proj": cast(_cols(t[m + "down_proj.weight"], rank, size))}
        w["layers"].append({
            "self_attn": attn, "mlp": mlp,
            "input_layernorm": cast(t[p + "input_layernorm.weight"]),
            "post_attention_layernorm": cast(t[p + "post_attention_layernorm.weight"])})
    return w


def _moe(t, m, cfg, rank, size, cast):
    """DeepseekV2MoE's shards: every expert's intermediate dim split over TP (FusedMoE
    w13 = [gate rows; up rows], w2 = down's columns), the shared expert as a TP MLP, or,
    with cfg's num_fused_shared_experts (dump.py --fuse-shared-experts), as expert
    n_routed_experts of w13/w2."""
    e = cfg["n_routed_experts"]
    if m + "experts.gate_up_proj" in t:  # transformers' fused layout
        gate_up, down = t[m + "experts.gate_up_proj"], t[m + "experts.down_proj"]
        gates, ups = gate_up.chunk(2, dim=1)
        w13 = [_gate_up(gates[j], ups[j], rank, size) for j in range(e)]
        w2 = [_cols(down[j], rank, size) for j in range(e)]
    else:
        x = m + "experts."
        w13 = [_gate_up(t[f"{x}{j}.gate_proj.weight"], t[f"{x}{j}.up_proj.weight"], rank,
                        size) for j in range(e)]
        w2 = [_cols(t[f"{x}{j}.down_proj.weight"], rank, size) for j in range(e)]
    s = m + "shared_experts."
    shared_w13 = _gate_up(t[s + "gate_proj.weight"], t[s + "up_proj.weight"], rank, size)
    shared_w2 = _cols(t[s + "down_proj.weight"], rank, size)
    out = {"gate": cast(t[m + "gate.weight"]), "bias": t[m + "gate.e_score_correction_bias"]}
    if cfg.get("num_fused_shared_experts", 0):
        # deepseek_weight_loader.py:311-315: mlp.shared_experts.* is renamed
        # mlp.experts.{n_routed_experts}.* and loaded by FusedMoE's expert mapping
        # (:265-270, num_experts = n_routed + 1) as one more expert, its intermediate dim
        # split over TP as the routed experts' are (fused_moe_triton/layer.py:383-416).
        w13, w2 = w13 + [shared_w13], w2 + [shared_w2]
    else:
        out["shared"] = {"gate_up_proj": cast(shared_w13), "down_proj": cast(shared_w2)}
    out.update({"w13": cast(torch.stack(w13)), "w2": cast(torch.stack(w2))})
    return out
