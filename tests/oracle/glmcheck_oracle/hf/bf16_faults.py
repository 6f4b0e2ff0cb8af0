#!/usr/bin/env python3
"""A bf16 Hugging Face checkpoint that transformers itself writes, and copies with one fault
planted in its safetensors bytes.

    python -m glmcheck_oracle.hf.bf16_faults F32_FOLDER OUT_FOLDER

Loads F32_FOLDER (a GlmMoeDsaForCausalLM folder) with transformers, casts it to bfloat16 and
saves it with `save_pretrained` to OUT_FOLDER/honest. Then, for each fault, copies that folder
to OUT_FOLDER/<fault> and rewrites one tensor of its safetensors file: `double` (layer 0's
o_proj × 2), `swap_experts` (experts 1 and 5 of layer 1's stacked or per-expert down
projections exchanged), `zero_bias` (layer 1's router correction bias zeroed), `nan` (one
value of layer 0's kv_a_proj_with_mqa set to NaN). Prints JSON:
{fault: {"dir", "tensor"}} with the tensor's name in the file.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def plant(folder: Path, fault: str) -> str:
    files = sorted(folder.glob("*.safetensors"))
    for f in files:
        tensors = load_file(f)
        name = pick(tensors, fault)
        if name is None:
            continue
        t = tensors[name]
        if fault == "double":
            tensors[name] = (t.float() * 2).to(t.dtype)
        elif fault == "swap_experts":
            if t.dim() == 3:
                t = t.clone()
                t[[1, 5]] = t[[5, 1]]
                tensors[name] = t
            else:
                other = name.replace("experts.1.", "experts.5.")
                tensors[name], tensors[other] = tensors[other], tensors[name]
        elif fault == "zero_bias":
            tensors[name] = torch.zeros_like(t)
        elif fault == "nan":
            t = t.clone()
            t.view(-1)[t.numel() // 3] = float("nan")
            tensors[name] = t
        save_file(tensors, f, metadata={"format": "pt"})
        return name
    raise SystemExit(f"{fault}: no tensor to plant it in")


def pick(tensors: dict, fault: str):
    want = {
        "double": lambda n: n == "model.layers.0.self_attn.o_proj.weight",
        "swap_experts": lambda n: n in ("model.layers.1.mlp.experts.down_proj",
                                        "model.layers.1.mlp.experts.1.down_proj.weight"),
        "zero_bias": lambda n: n.startswith("model.layers.1.mlp.gate.e_score_correction_bias"),
        "nan": lambda n: n == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    }[fault]
    return next((n for n in tensors if want(n)), None)


def main() -> None:
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    honest = out / "honest"
    model.to(torch.bfloat16).save_pretrained(honest)
    result = {"honest": {"dir": str(honest), "tensor": None}}
    for fault in ["double", "swap_experts", "zero_bias", "nan"]:
        d = out / fault
        shutil.copytree(honest, d)
        result[fault] = {"dir": str(d), "tensor": plant(d, fault)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
