"""The GGUFs the llama.cpp probe's tests run: honest conversions and planted faults.

Usage: python -m glmcheck_oracle.llamacpp.probe_models OUT_DIR --llama-cpp ORACLE [--seed S]

ORACLE is the folder scripts/setup-llamacpp builds (.oracles/llama.cpp): `src/` holds the
converter and its gguf-py, `build/tools/quantize/` the quantizer.
Writes into OUT_DIR, from the tiny GLM-5 of `llamacpp.model`:

* `hf/`: the transformers checkpoint (the reference);
* `f32.gguf`, `bf16.gguf`: llama.cpp's converter with `--outtype f32` / `bf16`;
* `q8_0.gguf`, `q4_k_m.gguf`: `llama-quantize f32.gguf OUT TYPE` (the oracle build's, or
  `$LLAMA_QUANTIZE`);
* `meta-FAULT.gguf`: f32.gguf with its metadata rewritten by gguf-py (every tensor copied as it
  is), one fault each (METADATA_FAULTS; a list value is written as an array);
* `NAME.gguf` for each of WEIGHT_FAULTS: one of the files above with a fault planted in its
  stored bytes by `formats.plant_gguf_fault` (random values in `attn_q_b`, heads of `attn_k_b` or
  `attn_v_b` swapped, two sibling tensors exchanged, the router's bias zeroed, the indexer's
  head weights negated).

Prints one line of JSON: {"hf", "f32", "bf16", "q8_0", "q4_k_m", "faults": {name: {"gguf",
"changed"}}}.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ARCH = "glm-dsa"

# name -> metadata keys (without `glm-dsa.`) set to (value, gguf-py value type name); None drops.
METADATA_FAULTS = {
    # A linear RoPE scaling the model was never trained with (llama.cpp: positions / factor).
    "rope-scaling": {"rope.scaling.type": ("linear", "STRING"), "rope.scaling.factor": (4.0, "FLOAT32")},
    # GLM-5's own 1e-5 on a model made with 1e-6.
    "rms-eps": {"attention.layer_norm_rms_epsilon": (1e-5, "FLOAT32")},
    # routed_scaling_factor lost: llama.cpp then does not scale the routing weights.
    "expert-weights-scale": {"expert_weights_scale": None},
    # norm_topk_prob lost: the key absent reads as false.
    "expert-weights-norm": {"expert_weights_norm": None},
    # softmax gating (1) where the model scores with sigmoid.
    "gating-func": {"expert_gating_func": (1, "UINT32")},
    # The DSA indexer keeping 3 keys where the model keeps 4.
    "indexer-top-k": {"attention.indexer.top_k": (3, "UINT32")},
    # One expert a token where the model routes to 2.
    "expert-used-count": {"expert_used_count": (1, "UINT32")},
    # Group-limited routing (the best 1 of 2 groups) on a one-group model.
    "expert-groups": {"expert_group_count": (2, "UINT32"), "expert_group_used_count": (1, "UINT32")},
    # Layer 2 told to reuse layer 1's top-k (GLM-5.2's shared indexers) on a model whose every
    # layer runs its own.
    "indexer-types": {"attention.indexer.types": ([1, 1, 0], "UINT32")},
}

# name -> (the file the fault is planted in, `formats.plant_gguf_fault`'s FAULT TENSOR
# ARGS...): faults in weights that only stages llama.cpp never records (attn.kv) or a later
# stage read.
WEIGHT_FAULTS = {
    "weight-garbage": ("f32", ["garbage", "blk.0.attn_q_b.weight", "0", "0", "8", "1"]),
    "k-b-heads": ("f32", ["swap-heads", "blk.1.attn_k_b.weight", "0", "2"]),
    "v-b-heads": ("q8_0", ["swap-heads", "blk.2.attn_v_b.weight", "1", "3"]),
    "k-b-v-b-swapped": ("f32", ["swap-tensors", "blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"]),
    "shexp-gate-up": ("q4_k_m", ["swap-tensors", "blk.1.ffn_gate_shexp.weight", "blk.1.ffn_up_shexp.weight"]),
    "exps-gate-up": ("q8_0", ["swap-tensors", "blk.2.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight"]),
    "router-bias-zero": ("f32", ["zero", "blk.1.exp_probs_b.bias"]),
    "indexer-proj-negated": ("q8_0", ["scale", "blk.0.indexer.proj.weight", "-1"]),
}


def rewrite_metadata(src: Path, dst: Path, changes: dict) -> None:
    """Copy `src` to `dst` with `changes` applied to its key-values; tensors are copied as
    stored (same types, shapes and bytes)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, arch=ARCH, endianess=reader.endianess)
    keys = {f"{ARCH}.{k}": v for k, v in changes.items()}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in keys:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, change in keys.items():
        if change is not None:
            value, vtype = change
            if isinstance(value, list):  # an array of `vtype`
                writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType[vtype])
            else:
                writer.add_key_value(key, value, GGUFValueType[vtype])
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = args.out.resolve()
    import torch
    from transformers import GlmMoeDsaForCausalLM

    from glmcheck_oracle.llamacpp import model as base
    from glmcheck_oracle.llamacpp import quants

    torch.manual_seed(args.seed)
    hf = out / "hf"
    model = GlmMoeDsaForCausalLM(base.config(1e-6)).float().eval()
    base.reinit(model, args.seed)
    model.save_pretrained(hf, safe_serialization=True)
    base.tokenizer().save_pretrained(hf)
    del model
    oracle = args.llama_cpp.resolve()
    f32, bf16 = out / "f32.gguf", out / "bf16.gguf"
    base.convert(oracle / "src", hf, f32)
    base.convert(oracle / "src", hf, bf16, "bf16")
    quantize = quants.tool(oracle, "llama-quantize", "LLAMA_QUANTIZE")
    for stem in ("q8_0", "q4_k_m"):
        quants.run([quantize, "f32.gguf", f"{stem}.gguf", quants.QUANTS[stem], quants.THREADS], out)

    faults = {}
    for name, changes in METADATA_FAULTS.items():
        path = out / f"meta-{name}.gguf"
        rewrite_metadata(f32, path, changes)
        faults[name] = {"gguf": str(path), "changed": {f"{ARCH}.{k}": v and v[0] for k, v in changes.items()}}
    for name, (stem, plant) in WEIGHT_FAULTS.items():
        path = out / f"{name}.gguf"
        done = subprocess.run(
            [sys.executable, "-m", "glmcheck_oracle.formats.plant_gguf_fault", str(out / f"{stem}.gguf"),
             str(path), *plant],
            capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"formats.plant_gguf_fault {name} failed:\n{done.stderr}")
        changed = json.loads(done.stdout.splitlines()[-1])
        if not changed["check"]["confirmed"]:
            raise SystemExit(f"formats.plant_gguf_fault {name}: not confirmed: {changed}")
        faults[name] = {"gguf": str(path), "changed": changed}
    files = {name: str(out / f"{name}.gguf") for name in ("f32", "bf16", "q8_0", "q4_k_m")}
    print(json.dumps({"hf": str(hf), **files, "faults": faults}))


if __name__ == "__main__":
    main()
