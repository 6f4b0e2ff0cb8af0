"""Build a tiny random member of the MLA/MoE family with transformers' own class and save it.

Usage: python -m glmcheck_oracle.hf.deepseek_model OUT ARCH [--neox] [--yarn] [--random SEED]
    [--set KEY=JSON]...
ARCH: v2 (DeepseekV2: softmax, group_limited_greedy, no bias), v2-lite (no q LoRA, greedy),
v3, v32, kimi-k2 (DeepseekV3 in one group, saved with Kimi-K2's `model_type: kimi_k2`),
glm-4.7-flash (Glm4MoeLite). `--random SEED` draws the sizes, routing, RoPE and YaRN settings
from `random.Random(SEED)` within what ARCH's class runs (see `drawn_config`); `--set` then
overrides a config field (e.g. `--set n_group=4`).

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
import random

import torch


def drawn_config(arch: str, seed: int) -> dict:
    """Config fields for ARCH drawn from `random.Random(seed)`: what real checkpoints vary, kept
    tiny, and only values ARCH's transformers class accepts and runs.

    Experts per group stay >= 2 (the sigmoid classes rank a group by its two best scores) and a
    token never chooses more experts than its open groups hold (the rest would be masked ties);
    the V3.2 indexer keeps >= 16 heads so its ReLU'd scores have no exact ties to break.
    """
    r = random.Random(seed)
    v2 = arch in ("v2", "v2-lite")
    heads = r.choice([1, 2, 3, 4, 6, 8])
    # DeepseekV2Config alone insists on heads dividing the hidden size.
    hidden = r.choice([h for h in range(32, 129, 16) if not v2 or h % heads == 0])
    layers = r.randint(2, 4)
    rope_dim = r.choice([2, 4, 6, 8, 12, 16])
    nope = r.choice([8, 12, 16, 24, 32])
    c = dict(
        vocab_size=r.randint(320, 512), hidden_size=hidden,
        intermediate_size=r.choice([48, 64, 96, 128, 160]),
        moe_intermediate_size=r.choice([16, 24, 32, 48]), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        kv_lora_rank=r.choice([8, 16, 24, 32, 48]), qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=nope if r.random() < 0.4 else r.choice([8, 12, 20, 32]),
        first_k_dense_replace=r.randint(0, layers - 1), n_shared_experts=r.choice([0, 1, 2]),
        routed_scaling_factor=round(r.uniform(0.5, 3.0), 3), norm_topk_prob=r.random() < 0.5,
        rms_norm_eps=r.choice([1e-6, 1e-5, 1e-3]),
        # No EOS: `generate(min_new_tokens=...)` would mask its logit, which a plain greedy
        # argmax (glmcheck's) keeps; on a tiny random model it is as likely as any token.
        eos_token_id=None,
    )
    if arch == "v2-lite":
        c["q_lora_rank"] = None
    elif arch in ("v2", "v3", "kimi-k2", "glm-4.7-flash"):
        c["q_lora_rank"] = r.choice([None, 16, 24, 32, 48])
    else:
        c["q_lora_rank"] = r.choice([16, 24, 32, 48])
    # Routing: groups of experts, the groups a token may use, the experts it chooses.
    if arch == "kimi-k2":
        n_group, per_group = 1, r.randint(4, 16)
    elif v2:
        n_group, per_group = r.choice([1, 2, 3, 4]), r.randint(1, 4)
    else:
        n_group, per_group = r.choice([1, 2, 4]), r.randint(2, 4)
    topk_group = r.randint(1, n_group)
    c.update(n_routed_experts=n_group * per_group, n_group=n_group, topk_group=topk_group,
             num_experts_per_tok=r.randint(1, min(topk_group * per_group, 6)))
    if v2:
        method = "greedy" if arch == "v2-lite" else r.choice(["greedy", "group_limited_greedy"])
        c["topk_method"] = method
        if method == "greedy":
            c["num_experts_per_tok"] = r.randint(1, min(n_group * per_group, 6))
    # Either scoring: the classes never read it (V2 softmax-scores, the others sigmoid).
    if (x := r.random()) < 0.5:
        c["scoring_func"] = "softmax" if x < 0.25 else "sigmoid"
    # DeepseekV32's MLA never reads the key (always interleaved pairs); it is drawn there too,
    # as a config.json may carry it.
    if not v2:
        c["rope_interleave"] = r.random() < 0.5
    theta = r.choice([10000.0, 50000.0, 1e6])
    if r.random() < 0.5:
        factor = r.choice([2.0, 4.0, 8.0, 16.0, 40.0])
        orig = r.choice([16, 32, 64, 4096])
        rope = {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                "original_max_position_embeddings": orig,
                "beta_fast": r.choice([16, 32, 64]), "beta_slow": r.choice([1, 2])}
        for key in ("mscale", "mscale_all_dim"):
            m = r.choice([None, 0.707, 1.0])
            if m is not None:
                rope[key] = m
        c["rope_parameters"] = rope
        c["max_position_embeddings"] = int(orig * factor)
    else:
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
        c["max_position_embeddings"] = r.choice([256, 4096, 163840])
    if arch == "v32":
        c.update(index_n_heads=r.choice([16, 24, 32]),
                 index_head_dim=r.choice([d for d in (8, 16, 24, 32, 48) if d >= rope_dim]),
                 index_topk=r.choice([2, 4, 8, 12, 20, 64]))
    if arch == "glm-4.7-flash":
        dense = c.pop("first_k_dense_replace")
        c["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (layers - dense)
    return c


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
    ap.add_argument("--random", type=int, metavar="SEED")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    a = ap.parse_args()
    sets = {k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)}
    if a.random is not None:
        sets = {**drawn_config(a.arch, a.random), **sets}
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
