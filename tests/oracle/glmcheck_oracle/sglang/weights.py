"""A Hugging Face folder of the family (GLM-5, DeepSeek-V2/V2-Lite/V3/V3.2, Kimi-K2, GLM-4.7-Flash;
`glmcheck synth --format hf`, per-expert or fused experts, FP8 block-scaled weights
dequantized) read into one TP rank's shards the way SGLang 0.5.23's loader lays them out
(models/deepseek_common/deepseek_weight_loader.py and the parallel layers' weight_loaders):
q_a_proj and kv_a_proj_with_mqa concatenated into fused_qkv_a_proj_with_mqa (without a q LoRA
q_proj split by heads, kv_a_proj_with_mqa replicated); q_b_proj, kv_b_proj and gate/up split by
output rows (whole heads, in rank order), o_proj and down_proj by input columns; embed_tokens
and lm_head split by vocabulary rows (padded to 64); norms, the indexer and the router
replicated.
"""

import glob
import json
import os

import torch
from safetensors import safe_open

from glmcheck_oracle.sglang.layers import tp


# The classes SGLang 0.5.23 serves the family with, by config.json's `architectures`: all but
# GLM-4.7-Flash's are DeepseekV2ForCausalLM (dv2:3248) or its subclasses (DeepseekV3ForCausalLM
# dv2:3518, which Kimi-K2's checkpoint names; DeepseekV32ForCausalLM dv2:3522;
# GlmMoeDsaForCausalLM glm4_moe.py:1284); Glm4MoeLiteForCausalLM (glm4_moe_lite.py:685) has its
# own layers and MoE around DeepseekV2AttentionMLA.
ARCHITECTURES = ("GlmMoeDsaForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                 "DeepseekV32ForCausalLM", "Glm4MoeLiteForCausalLM")


def config(hf_dir: str) -> dict:
    """config.json with the fields the model reads filled as SGLang fills absent ones, and
    `lite` (GLM-4.7-Flash's classes), `dsa` (the DSA indexer) and `rope_scaling` as SGLang
    derives them."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise SystemExit(f"{hf_dir}: architectures {cfg.get('architectures')}, none of "
                         f"{', '.join(ARCHITECTURES)}")
    cfg["lite"] = arch == "Glm4MoeLiteForCausalLM"
    # configs/model_config.py:191 is_deepseek_dsa: the architecture and an index_topk.
    cfg["dsa"] = (arch in ("GlmMoeDsaForCausalLM", "DeepseekV3ForCausalLM",
                           "DeepseekV32ForCausalLM") and cfg.get("index_topk") is not None)
    rope = cfg.get("rope_parameters")
    if cfg["lite"]:
        # glm4_moe_lite.py:424 → hf_transformers/common.py:501 get_rope_config: transformers 5's
        # whole rope_parameters, rope_type "default" included.
        cfg["rope_theta"] = (rope or {}).get("rope_theta", cfg.get("rope_theta", 10000))
        scaling = rope if rope is not None else cfg.get("rope_scaling")
    elif rope is not None:  # dv2:2605-2613
        cfg["rope_theta"] = rope["rope_theta"]
        scaling = rope if rope.get("rope_type") != "default" else None
    else:
        scaling = cfg.get("rope_scaling")
    # dv2:2065-2066: the MLA attention runs any rope_scaling as deepseek_yarn (GLM-4.7-Flash's
    # "default" one as YaRN of factor 1: the plain frequencies, every mscale 1).
    cfg["rope_scaling"] = dict(scaling, rope_type="deepseek_yarn") if scaling else None
    if cfg.get("scoring_func", "softmax") not in ("softmax", "sigmoid"):
        # layers/moe/topk.py:1398-1403 grouped_topk_gpu scores no other way.
        raise SystemExit(f"{hf_dir}: scoring_func {cfg['scoring_func']!r}")
    n = cfg["num_hidden_layers"]
    cfg.setdefault("q_lora_rank", None)  # dv2:2630-2632
    cfg.setdefault("indexer_types", ["full"] * n)
    cfg.setdefault("n_group", 1)
    cfg.setdefault("topk_group", 1)
    cfg.setdefault("moe_layer_freq", 1)
    if cfg["lite"]:
        cfg["moe_layer_freq"] = 1  # glm4_moe_lite.py:421
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
        q_part = size - 1 - rank if fault == "rank-order-q-b" else rank
        kv_b_part = 0 if fault == "unsharded-kv-b" else rank
        attn = {
            "kv_a_layernorm": cast(t[a + "kv_a_layernorm.weight"]),
            "kv_b_proj": cast(_rows(t[a + "kv_b_proj.weight"], kv_b_part, size)),
            "o_proj": cast(_cols(t[a + "o_proj.weight"], rank, size)),
            "indexer": None,
        }
        if cfg["q_lora_rank"] is not None:
            attn.update({
                "fused_qkv_a": cast(torch.cat([t[a + "q_a_proj.weight"],
                                               t[a + "kv_a_proj_with_mqa.weight"]])),
                "q_a_layernorm": cast(t[a + "q_a_layernorm.weight"]),
                "q_b_proj": cast(_rows(t[a + "q_b_proj.weight"], q_part, size))})
        else:  # dv2:2087-2101: q_proj column-parallel, kv_a_proj_with_mqa replicated
            attn.update({
                "q_proj": cast(_rows(t[a + "q_proj.weight"], q_part, size)),
                "kv_a_proj_with_mqa": cast(t[a + "kv_a_proj_with_mqa.weight"])})
        if cfg["dsa"] and cfg["indexer_types"][i] == "full":
            # a "shared" layer has no indexer (dv2:2117)
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
    # DeepseekV2's MoEGate keeps its weight in the model dtype unless router_fp32 and has a
    # correction bias only for noaux_tc (dv2:509-537); GLM-4.7-Flash's gate holds both in f32
    # (glm4_moe_lite.py:158-165).
    f32_gate = cfg["lite"] or cfg.get("router_fp32", False)
    out = {"gate": t[m + "gate.weight"] if f32_gate else cast(t[m + "gate.weight"]),
           "bias": (t[m + "gate.e_score_correction_bias"]
                    if cfg["lite"] or cfg.get("topk_method") == "noaux_tc" else None)}
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
