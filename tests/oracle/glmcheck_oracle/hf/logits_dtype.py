"""Logits of a Hugging Face folder run by transformers at a dtype:
`python -m glmcheck_oracle.hf.logits_dtype FOLDER TOKENS DTYPE OUT.npy` (float32 [T, V])."""

import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    folder, tokens, dtype, out = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], sys.argv[3], sys.argv[4]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float().numpy()
    np.save(out, logits)


if __name__ == "__main__":
    main()
