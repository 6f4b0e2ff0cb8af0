"""Load a llama.cpp `glm-dsa` GGUF into vLLM 0.23's own `GlmMoeDsaForCausalLM`, as a user
serving one on vLLM must.

vLLM 0.23's GGUF loader (`vllm/model_executor/model_loader/gguf_loader.py`) maps `deepseek2`
but not `glm-dsa` ("Unknown gguf model_type: glm_moe_dsa"), and never rebuilds `kv_b_proj`,
which llama.cpp stores split per head into `attn_k_b` / `attn_v_b`. The patch a user writes,
and this module, therefore does three things and leaves the rest to vLLM:

* maps glm-dsa tensor names to the checkpoint names `DeepseekV2ForCausalLM.load_weights`
  expects (the routed experts as one stacked tensor under expert 0's name, as 0.23 does for
  deepseek2);
* re-assembles `kv_b_proj` from `attn_k_b` / `attn_v_b`, dequantized: the two halves are
  quantized along different axes, so their blocks cannot be re-joined as bytes;
* dequantizes what vLLM has no quantized path for (the indexer's fused `wk_weights_proj` and
  the router `mlp.gate` are built without a quant config; types outside vLLM's GGUF list).

Every other tensor goes through vLLM's own pieces unchanged: `GGUFConfig` decides each layer's
method (`qweight` / `qweight_type` parameters, `unquantized_modules` for float ones, as
`GGUFModelLoader.load_model` computes them), `gguf_quant_weights_iterator`'s convention (all
types first, then the data; `weight` renamed `qweight` for quantized tensors) feeds
`model.load_weights`, whose `weight_loader`s cut each rank's shard, and
`process_weights_after_loading` finishes the load.

`fault="unsharded-kv-b"` is the deployment bug under test: the patch hands every rank the whole
re-assembled `kv_b_proj` and copies its leading rows into the rank's parameter, bypassing the
`weight_loader` that would narrow it at the rank's offset — so every rank holds rank 0's heads,
and the shapes still fit.
"""

import json
import os
import re

import gguf
import numpy as np
import torch

FAULTS = ("unsharded-kv-b",)

# glm-dsa tensor names after `blk.N.` → checkpoint names after `model.layers.N.`.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # old GGUFs: kv_b unsplit
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    # FusedMoE's weight_loader takes all experts at once when handed a 3-D tensor.
    "ffn_gate_exps.weight": "mlp.experts.0.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.0.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.0.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")
# Built without a quant config in vLLM 0.23 (deepseek_v2.py: Indexer.wk_weights_proj,
# DeepseekV2MoE.gate): only float weights load there.
FLOAT_ONLY = ("self_attn.indexer.wk.weight", "self_attn.indexer.weights_proj.weight",
              "mlp.gate.weight")
# Parts of one vLLM module: if one part must be float, all must (vLLM refuses a mix).
FUSED = [("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
         ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
         ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")]
FLOAT_TYPES = {"F32", "F16", "BF16"}
BLOCK = re.compile(r"^blk\.([0-9]+)\.(.+)$")


def hf_config(gguf_path: str, hf_dir: str) -> dict:
    """The model's Hugging Face config (what vLLM's `--hf-config-path` points at), checked
    against the GGUF's shapes: a mismatched pair would load silently wrong."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"]
    arch = bytes(arch.parts[arch.data[0]]).decode()
    if arch != "glm-dsa":
        raise ValueError(f"{gguf_path}: architecture {arch!r}, not glm-dsa")
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    if [int(x) for x in emb.shape] != [cfg["hidden_size"], cfg["vocab_size"]]:
        raise ValueError(f"{hf_dir}/config.json does not describe {gguf_path} "
                         f"(token_embd ne {list(emb.shape)})")
    return cfg


class GgufWeights:
    """The GGUF's tensors under checkpoint names, for one model config."""

    def __init__(self, path: str, num_layers: int, quant_types: set, float_only=FLOAT_ONLY):
        """`quant_types`: the GGML types the engine's GGUF layers take as bytes (vLLM's
        `DEQUANT_TYPES | UNQUANTIZED_TYPES`); the others, and the checkpoint names ending in
        one of `float_only`, are handed over dequantized."""
        self.reader = gguf.GGUFReader(path)
        self.quant_types = quant_types
        self.float_only = tuple(float_only)
        self.num_layers = num_layers
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.names = {}  # checkpoint name → GGUF tensor name
        self.kv_b = {}  # layer → (attn_k_b tensor, attn_v_b tensor)
        for name in self.tensors:
            self._map(name)
        self.float_names = self._float_names()

    def _map(self, name: str) -> None:
        if name in TOP_NAMES:
            self.names[TOP_NAMES[name]] = name
            return
        m = BLOCK.match(name)
        if not m:
            raise ValueError(f"GGUF tensor {name}: not a glm-dsa name this loader maps")
        layer, tail = int(m.group(1)), m.group(2)
        if layer >= self.num_layers:
            return  # the MTP layer: vLLM's main model skips it too
        if tail in KV_B_PARTS:
            self.kv_b.setdefault(layer, [None, None])[KV_B_PARTS.index(tail)] = self.tensors[name]
            return
        if tail not in LAYER_NAMES:
            raise ValueError(f"GGUF tensor {name}: not a glm-dsa name this loader maps")
        self.names[f"model.layers.{layer}.{LAYER_NAMES[tail]}"] = name

    def _float_names(self) -> set:
        """Checkpoint names handed to vLLM as float: the file's float tensors, those vLLM has
        no quantized path for, and the parts fused with one of them."""
        quant_ok = self.quant_types
        out = {f"model.layers.{n}.self_attn.kv_b_proj.weight" for n in self.kv_b}
        for hf, g in self.names.items():
            t = self.tensors[g]
            if (t.tensor_type.name in FLOAT_TYPES or hf.endswith(self.float_only)
                    or t.tensor_type not in quant_ok):
                out.add(hf)
        for hf in list(out):
            for parts in FUSED:
                for p in parts:
                    if hf.endswith("." + p):
                        out.update(hf[: -len(p)] + q for q in parts)
        # GGUF experts always take GGUFMoEMethod in vLLM (float types included: its kernels
        # take F32/F16/BF16 too), so they stay on the qweight path.
        for hf in [hf for hf in out if ".mlp.experts." in hf]:
            if self.tensors[self.names[hf]].tensor_type not in quant_ok:
                raise ValueError(f"{hf}: GGUF type vLLM's MoE cannot use")
            out.discard(hf)
        return out

    def unquantized_modules(self) -> list:
        """`GGUFConfig(unquantized_modules=…)`: modules whose weight arrives as float."""
        return sorted(n.removesuffix(".weight") for n in self.float_names
                      if n.endswith(".weight"))

    def dequantized(self, gguf_name: str) -> torch.Tensor:
        t = self.tensors[gguf_name]
        return torch.from_numpy(
            np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))

    def kv_b_proj(self, layer: int) -> torch.Tensor:
        """`kv_b_proj` [heads·(nope+v), kv_lora] from llama.cpp's split halves: per head,
        attn_k_b [kv_lora, nope] transposed back, then attn_v_b [v, kv_lora]."""
        k_b, v_b = self.kv_b[layer]
        if k_b is None or v_b is None:
            raise ValueError(f"blk.{layer}: attn_k_b and attn_v_b must both be present")
        k = gguf.quants.dequantize(k_b.data, k_b.tensor_type)  # [heads, kv_lora, nope]
        v = gguf.quants.dequantize(v_b.data, v_b.tensor_type)  # [heads, v, kv_lora]
        heads, lora = k.shape[0], k.shape[1]
        kv = np.concatenate([k.transpose(0, 2, 1), v], axis=1).reshape(-1, lora)
        assert v.shape[0] == heads
        return torch.from_numpy(np.ascontiguousarray(kv, dtype=np.float32))

    def quantized_torch(self, gguf_name: str) -> torch.Tensor:
        """The tensor's bytes as vLLM's `gguf_quant_weights_iterator` hands them over."""
        return torch.from_numpy(np.array(self.tensors[gguf_name].data))

    def weights(self, skip=()):
        """(name, tensor) in vLLM's GGUF order: every `qweight_type` first, then the data."""
        for hf, g in self.names.items():
            if hf not in self.float_names:
                t = self.tensors[g]
                yield hf.replace("weight", "qweight_type"), torch.tensor(t.tensor_type)
        for hf, g in self.names.items():
            if hf in skip:
                continue
            if hf not in self.float_names:
                yield hf.replace("weight", "qweight"), self.quantized_torch(g)
            else:
                yield hf, self.dequantized(g)
        for layer in sorted(self.kv_b):
            name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
            if name not in skip:
                yield name, self.kv_b_proj(layer)


def load(model, weights: GgufWeights, fault: str | None = None) -> None:
    """Feed the GGUF to `model.load_weights` (vLLM's weight_loaders cut every shard), with the
    deployment fault if asked."""
    if fault not in (None,) + FAULTS:
        raise ValueError(f"fault {fault!r}: one of {FAULTS}")
    skip = set()
    if fault == "unsharded-kv-b":
        skip = {f"model.layers.{n}.self_attn.kv_b_proj.weight" for n in weights.kv_b}
    model.load_weights(weights.weights(skip))
    if fault == "unsharded-kv-b":
        params = dict(model.named_parameters())
        for layer in weights.kv_b:
            whole = weights.kv_b_proj(layer)
            param = params[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
            param.data.copy_(whole[: param.shape[0]])
