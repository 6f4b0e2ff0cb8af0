"""A tiny transformers GlmMoeDsaForCausalLM saved as a Hugging Face folder, and its kv_b_proj split
the way llama.cpp's converter splits it, for tests/transformers/kv_b_transformers.rs.

OUTDIR/hf/            save_pretrained output (config.json, safetensors)
OUTDIR/split.gguf     per layer: attn_k_b [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora] (F32)
OUTDIR/folded.gguf    the same tensors with heads folded into one dimension (2-D), as ik_llama.cpp writes
OUTDIR/kv_b.json      dims and layer count
"""

import json
import sys
from pathlib import Path

import torch
from gguf import GGUFWriter
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

HEADS, KV_LORA, NOPE, ROPE, V = 4, 32, 16, 8, 24


def tiny_model() -> GlmMoeDsaForCausalLM:
    torch.manual_seed(0)
    cfg = GlmMoeDsaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=48, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        index_n_heads=2, index_head_dim=32, index_topk=4, rope_interleave=True,
        max_position_embeddings=256, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    model = GlmMoeDsaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # random everywhere, so every element of kv_b is distinct
    return model


def llama_cpp_split(kv_b: torch.Tensor):
    """llama.cpp's converter: view per head, split [nope, v], transpose the K part per head."""
    kv_b = kv_b.view(HEADS, NOPE + V, KV_LORA)
    k_b, v_b = torch.split(kv_b, [NOPE, V], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def main(outdir: Path) -> None:
    model = tiny_model()
    model.save_pretrained(outdir / "hf")
    layers = model.config.num_hidden_layers
    split = GGUFWriter(outdir / "split.gguf", arch="glm-dsa")
    folded = GGUFWriter(outdir / "folded.gguf", arch="glm-dsa")
    for layer in range(layers):
        kv_b = model.model.layers[layer].self_attn.kv_b_proj.weight.detach().float()
        k_b, v_b = llama_cpp_split(kv_b)
        for w, fold in ((split, False), (folded, True)):
            k, v = k_b.numpy(), v_b.numpy()
            if fold:
                k, v = k.reshape(HEADS * KV_LORA, NOPE), v.reshape(HEADS * V, KV_LORA)
            w.add_tensor(f"blk.{layer}.attn_k_b.weight", k)
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", v)
    for w in (split, folded):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    dims = {"heads": HEADS, "kv_lora": KV_LORA, "nope": NOPE, "v": V, "layers": layers}
    (outdir / "kv_b.json").write_text(json.dumps(dims))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
