"""The logits of a plain transformers forward, no hooks: what a probe's `logits` stage must equal.

Usage: python -m glmcheck_oracle.hf.logits FOLDER TOKENS(comma-separated)
Prints JSON {"shape": [T, V], "logits": [...]} (row-major; float32 values, exact as JSON floats).
"""

import json
import sys

import torch
from glmcheck_oracle.hf.load import causal_lm


def main() -> None:
    folder, tokens = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    model = causal_lm(folder)
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0]
    print(json.dumps({"shape": list(logits.shape), "logits": logits.reshape(-1).tolist()}))


if __name__ == "__main__":
    main()
