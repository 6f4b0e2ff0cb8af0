"""Load a Hugging Face folder of any member of the family with transformers.

Kimi-K2's config.json names `model_type: kimi_k2`, which transformers does not register: the
checkpoint ships DeepSeek-V3's class (`architectures: [DeepseekV3ForCausalLM]`), so it is
loaded as that, the way vLLM and SGLang map it.
"""

import json
import os

import torch


def causal_lm(folder: str, dtype=torch.float32):
    import transformers as tf

    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") == "kimi_k2":
        cfg["model_type"] = "deepseek_v3"
        config = tf.DeepseekV3Config.from_dict(cfg)
        return tf.DeepseekV3ForCausalLM.from_pretrained(folder, config=config, dtype=dtype).eval()
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
