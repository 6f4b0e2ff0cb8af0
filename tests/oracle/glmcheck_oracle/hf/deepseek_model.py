"""Build a tiny random member of the MLA/MoE family with transformers' own class and save it.

Usage: python -m glmcheck_oracle.hf.deepseek_model OUT ARCH [--neox] [--yarn] [--set KEY=JSON]...
ARCH: v2 (DeepseekV2: softmax, group_limited_greedy, no bias), v2-lite (no q LoRA, greedy),
v3, v32, kimi-k2 (DeepseekV3 in one group, saved with Kimi-K2's `model_type: kimi_k2`),
glm-4.7-flash (Glm4MoeLite). `--set` overrides a config field (e.g. `--set n_group=4`).

transformers' GLM-5 class always rotates interleaved pairs; its DeepSeek-V3 class rotates NeoX
halves when `rope_interleave` is false, and its DeepSeek-V3.2 indexer always does: these models
test the reference's other RoPE paths, YaRN scaling, and dense (indexer-less) MLA. Weights are
re-drawn so that activations are well scaled and logits peaked (projections N(0, 1/fan_in), norm
weights 1 + 0.2·N, the expert-choice bias 0.3·N, lm_head × 3); the default init (std 0.02)
gives logits so flat that top-1 would hinge on rounding.
"""

import argparse
import json
import os

import torch


def build(arch: str, neox: bool, yarn: bool, sets: dict):
    import transformers as tf

    common = dict(
        vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256,
        tie_word_embeddings=False, rope_interleave=not neox,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        # mscale ≠ mscale_all_dim: cos/sin and the softmax scale both change.
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                "mscale": 0.707, "mscale_all_dim": 1.0}
    common["rope_parameters"] = rope
    if arch == "v2":
        # Two experts from the one best of four groups of two: the limit by each group's best
        # score changes choices (with topk_group >= num_experts_per_tok it never would).
        common.update(topk_method="group_limited_greedy", n_group=4, topk_group=1,
                      routed_scaling_factor=16.0, norm_topk_prob=False)
    elif arch == "v2-lite":
        common.update(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None,
                      routed_scaling_factor=1.0, norm_topk_prob=False)
    elif arch == "kimi-k2":
        common.update(n_group=1, topk_group=1, routed_scaling_factor=2.827)
    elif arch == "glm-4.7-flash":
        del common["first_k_dense_replace"]
        common.update(mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=1.8)
    common.update(sets)
    if arch in ("v2", "v2-lite"):
        for key in ("rope_interleave",):
            common.pop(key)
        cfg = tf.DeepseekV2Config(**common)
        cls = tf.DeepseekV2ForCausalLM
    elif arch in ("v3", "kimi-k2"):
        cfg = tf.DeepseekV3Config(**common)
        cls = tf.DeepseekV3ForCausalLM
    elif arch == "glm-4.7-flash":
        cfg = tf.Glm4MoeLiteConfig(**common)
        cls = tf.Glm4MoeLiteForCausalLM
    else:
        cfg = tf.DeepseekV32Config(**{"index_n_heads": 16, "index_head_dim": 32, "index_topk": 4, **common})
        cls = tf.DeepseekV32ForCausalLM
    torch.manual_seed(5)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "norm" in name and name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        model.lm_head.weight.mul_(3)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn_like(b))
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("arch", choices=["v2", "v2-lite", "v3", "v32", "kimi-k2", "glm-4.7-flash"])
    ap.add_argument("--neox", action="store_true")
    ap.add_argument("--yarn", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    a = ap.parse_args()
    sets = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    save(build(a.arch, a.neox, a.yarn, sets), a.arch, a.out)


def save(model, arch: str, out, **config_keys) -> None:
    """`save_pretrained` into OUT, then give config.json what the real checkpoint's has and
    transformers' class does not write: Kimi-K2's `model_type`, and any `config_keys`."""
    model.save_pretrained(out)
    if arch == "kimi-k2":
        # Kimi-K2's own config.json: its model_type on DeepSeek-V3's class.
        config_keys = {"model_type": "kimi_k2", **config_keys}
    if config_keys:
        path = os.path.join(out, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(config_keys)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)


if __name__ == "__main__":
    main()
