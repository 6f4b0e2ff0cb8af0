"""A tiny random member of the MLA/MoE family made with transformers, converted to an F32 GGUF by
llama.cpp's converter, for llama.cpp parity beyond GLM-5 (tests/llamacpp/llamacpp_family.rs).

Usage: python -m glmcheck_oracle.llamacpp.family OUT_DIR ARCH --llama-cpp SRC [--yarn]
           [--set KEY=JSON]... [--tokens IDS]... [--generate N] [--whole-kv-b] [--drop-key KEY]...
           [--wide] [--quantize TYPE]...

ARCH is one of glmcheck_oracle.hf.deepseek_model's (v2, v2-lite, v3, kimi-k2, glm-4.7-flash;
`--yarn` and `--set` as there). Writes into OUT_DIR:

* `hf/`: the checkpoint, with the toy tokenizer of glmcheck_oracle.llamacpp.model and the
  config.json keys the real checkpoints carry but transformers' classes do not write:
  `scoring_func` (without it the converter writes no `expert_gating_func` and llama.cpp's deepseek2
  loader reads softmax) and, for GLM-4.7-Flash, `first_k_dense_replace` (the converter's count of
  dense leading layers; the class has only `mlp_layer_types`);
* `model-f32.gguf`: the converter's `--outtype f32` output (arch `deepseek2`), or with
  `--whole-kv-b` that file rewritten to the legacy whole `attn_kv_b` form, or with
  `--drop-key KEY` without that metadata key (the arch's prefix added: `expert_gating_func`,
  `rope.scaling.yarn_log_multiplier`), as an older converter left it out;
* `hf-logits-K.f32`: transformers' float32 logits of the K-th `--tokens` sequence, [T][V];
* with `--quantize TYPE` (llama-quantize's name, e.g. Q8_0, Q4_K_M): `TYPE.gguf` (lower case),
  `llama-quantize model-f32.gguf TYPE.gguf TYPE`, the tool found as
  glmcheck_oracle.llamacpp.quants finds it in the oracle folder holding SRC (`$LLAMA_QUANTIZE`
  names another).

Prints JSON: {"hf", "gguf", "vocab_size", "sequences": [{"tokens", "logits", "generated"}],
"quants": {TYPE: path}, "types": {"f32" or TYPE: {tensor: GGML type name}}}, `generated` being
transformers' `--generate N` greedy tokens (argmax over the whole vocabulary, as llama.cpp's
dump_logits and glmcheck take them: `generate`'s min_new_tokens would mask EOS); `quants` and
`types` only with `--quantize`. Without `--tokens` transformers never reloads the checkpoint.

`--wide` widens the model for K-quants as glmcheck_oracle.llamacpp.quants widens GLM-5 (see
`WIDE`): the rows of every matrix llama-quantize quantizes are 256 or 512 values long (hidden,
q_lora_rank, kv_lora_rank, heads x v_head_dim, intermediate and moe_intermediate sizes, the V3.2
indexer's inputs), but attn_k_b's, qk_nope_head_dim (64) long, for which llama-quantize falls
back to another type as it does on the real models.

What the sizes keep clear of: llama.cpp reads `attention.q_lora_rank` as required unless the
model has 26 or 27 layers (its test for DeepSeek-V2-Lite), so the V2-Lite model (no q LoRA) has
27; DeepSeek-V3's YaRN is written with mscale = mscale_all_dim (as the real config has), because
the converter keeps only mscale_all_dim and llama.cpp scales cos/sin as if they were equal.
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from glmcheck_oracle.hf import deepseek_model
from glmcheck_oracle.hf.load import causal_lm
from glmcheck_oracle.llamacpp import model as glm
from glmcheck_oracle.llamacpp import quants

# The converter's pre-tokenizer name for each member's real tokenizer.
PRE = {
    "v2": "deepseek-llm",
    "v2-lite": "deepseek-llm",
    "v3": "deepseek-v3",
    "v32": "deepseek-v3",
    "kimi-k2": "kimi-k2",
    "glm-4.7-flash": "glm4",
}
# Each member's real `scoring_func`.
SCORING = {"v2": "softmax", "v2-lite": "softmax", "v3": "sigmoid", "v32": "sigmoid", "kimi-k2": "sigmoid", "glm-4.7-flash": "sigmoid"}


# `--wide`: widths for K-quants (the module doc); layers, experts and routing stay deepseek_model's
# (3 layers, 8 routed experts and a shared one).
WIDE = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=4, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64,
    qk_rope_head_dim=16, v_head_dim=64,
)
# V2-Lite keeps the 27 layers llama.cpp needs (the module doc): all but the last two dense, with
# a narrower FFN, so that its F32 file stays small (72 MB; the 3-layer members' 22 MB).
WIDE_V2_LITE = dict(intermediate_size=256, first_k_dense_replace=25)


def sizes(arch: str, yarn: bool, wide: bool = False) -> dict:
    """Overrides of deepseek_model's config: GLM-5's oracle vocabulary (512, so the tests share
    its token sequences) and what llama.cpp needs (see the module doc); `wide`: `WIDE`."""
    out = {"vocab_size": 512, "bos_token_id": glm.GMASK_ID, "eos_token_id": glm.EOS_ID, "pad_token_id": glm.EOS_ID}
    if wide:
        out.update(WIDE, q_lora_rank=None if arch == "v2-lite" else WIDE["q_lora_rank"])
        if arch == "v2-lite":
            out.update(WIDE_V2_LITE)
    if arch == "v2-lite":
        out["num_hidden_layers"] = 27
    if arch == "v32":
        out["index_head_dim"] = 64
    if yarn:
        out["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
            "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0,
        }
    return out


def copy_metadata(reader, writer, drop=(), replace=None) -> None:
    """Every key of `reader` but the virtual ones and `drop`, with `replace`'s values instead."""
    from gguf import GGUFValueType

    replace = replace or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name in drop:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, replace.get(field.name, field.contents()), vtype, sub)


def rewrite(src: Path, dst: Path, whole_kv_b: bool, drop_keys: list) -> None:
    """Copy an F32 deepseek2 GGUF with the legacy whole `attn_kv_b` and/or without the metadata
    keys `drop_keys` (without the arch's prefix).

    The legacy form is what llama.cpp's converter wrote before MLA absorption (and what its
    deepseek2 loader still runs, unabsorbed, when `key_length_mla` is absent): per layer
    `attn_kv_b` [heads·(nope+v), kv_lora], head-major, each head its K rows then its V rows —
    the inverse of the split (src/model/kv_b.rs: attn_k_b[h] = W_UK[h]ᵀ, attn_v_b[h] = W_UV[h]);
    `key_length` nope+rope and `value_length` v per head, and as many KV heads as heads."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    key = lambda k: f"{arch}.{k}"  # noqa: E731
    get = lambda k: reader.fields[key(k)].contents()  # noqa: E731
    drop, replace = {key(k) for k in drop_keys}, {}
    missing = drop - set(reader.fields)
    assert not missing, f"the converter wrote none of {sorted(missing)}"
    if whole_kv_b:
        rope = get("rope.dimension_count")
        drop |= {key("attention.key_length_mla"), key("attention.value_length_mla")}
        replace = {
            key("attention.key_length"): get("attention.key_length_mla"),
            key("attention.value_length"): get("attention.value_length_mla"),
            key("attention.head_count_kv"): get("attention.head_count"),
        }
        assert get("attention.key_length_mla") > rope
    writer = GGUFWriter(dst, arch=arch)
    copy_metadata(reader, writer, drop, replace)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        data = np.array(t.data, dtype=np.float32)
        if whole_kv_b and t.name.endswith(".attn_v_b.weight"):
            continue
        if whole_kv_b and t.name.endswith(".attn_k_b.weight"):
            v_b = np.array(tensors[t.name.replace("attn_k_b", "attn_v_b")].data, dtype=np.float32)
            heads, kv_lora, _ = data.shape
            kv_b = np.concatenate([data.transpose(0, 2, 1), v_b], axis=1).reshape(-1, kv_lora)
            writer.add_tensor(t.name.replace("attn_k_b", "attn_kv_b"), np.ascontiguousarray(kv_b))
            continue
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def greedy(model, tokens: list, n: int) -> list:
    """`n` tokens, each the argmax of the whole vocabulary after the sequence so far."""
    seq = list(tokens)
    for _ in range(n):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        seq.append(int(torch.argmax(logits)))
    return seq[len(tokens) :]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("arch", choices=sorted(PRE))
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--yarn", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON")
    ap.add_argument("--tokens", action="append", default=[])
    ap.add_argument("--generate", type=int, default=0)
    ap.add_argument("--whole-kv-b", action="store_true")
    ap.add_argument("--drop-key", action="append", default=[], metavar="KEY")
    ap.add_argument("--wide", action="store_true")
    ap.add_argument("--quantize", action="append", default=[], metavar="TYPE")
    a = ap.parse_args()

    sets = sizes(a.arch, a.yarn, a.wide)
    sets.update({k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)})
    hf = a.out / "hf"
    extra = {"scoring_func": SCORING[a.arch]}
    if a.arch == "glm-4.7-flash":
        extra["first_k_dense_replace"] = sets.get("mlp_layer_types", ["dense"]).count("dense")
    deepseek_model.save(deepseek_model.build(a.arch, False, a.yarn, sets), a.arch, hf, **extra)
    glm.tokenizer().save_pretrained(hf)
    if a.arch == "v32":
        # DeepSeek-V3.2's tokenizer_config.json says so, and the converter asserts it.
        path = hf / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "add_bos_token": True, "bos_token": "[gMASK]"}))

    # The reference is the reloaded checkpoint: what glmcheck and the converter read.
    model = causal_lm(str(hf)) if a.tokens else None
    sequences = []
    for k, ids in enumerate(a.tokens):
        tokens = [int(t) for t in ids.split(",")]
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float()
            generated = greedy(model, tokens, a.generate)
        path = a.out / f"hf-logits-{k}.f32"
        logits.contiguous().numpy().astype("<f4").tofile(path)
        sequences.append({"tokens": tokens, "logits": str(path), "generated": generated})

    gguf = a.out / "model-f32.gguf"
    converted = a.out / "converted-f32.gguf" if a.whole_kv_b or a.drop_key else gguf
    glm.convert(a.llama_cpp, hf, converted, pre=PRE[a.arch])
    if converted != gguf:
        rewrite(converted, gguf, a.whole_kv_b, a.drop_key)
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    out = {"hf": str(hf), "gguf": str(gguf), "vocab_size": vocab, "sequences": sequences}
    if a.quantize:
        out.update(quantize(a.llama_cpp.resolve().parent, gguf, a.quantize))
    print(json.dumps(out))


def quantize(oracle: Path, f32: Path, qtypes: list) -> dict:
    """`llama-quantize` of the F32 GGUF to each of `qtypes`, beside it: {"quants", "types"}."""
    quantize_tool = quants.tool(oracle, "llama-quantize", "LLAMA_QUANTIZE")
    files = {}
    for qtype in qtypes:
        files[qtype] = f32.parent / f"{qtype.lower()}.gguf"
        quants.run([quantize_tool, f32.name, files[qtype].name, qtype, quants.THREADS], f32.parent)
    types = {"f32": quants.types_of(f32), **{q: quants.types_of(p) for q, p in files.items()}}
    return {"quants": {q: str(p) for q, p in files.items()}, "types": types}


if __name__ == "__main__":
    main()
