"""Greedy generation with transformers: `python -m glmcheck_oracle.hf.generate FOLDER TOKENS N`
→ JSON list of N new ids."""

import json
import sys

import torch
from glmcheck_oracle.hf.load import causal_lm


def main() -> None:
    folder, tokens, n = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
    model = causal_lm(folder)
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    print(json.dumps(out[0, len(tokens):].tolist()))


if __name__ == "__main__":
    main()
