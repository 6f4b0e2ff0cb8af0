"""Load a synthetic Hugging Face folder of the family with transformers and run a forward.

Usage: python -m glmcheck_oracle.hf.forward FOLDER TOKENS(comma-separated) [--fp16-layer L]
Prints JSON: per position the argmax and the entropy of the next-token distribution, ln V,
the largest |hidden state| after every layer, and whether every logit is finite.
"""

import json
import math
import sys

import torch
from glmcheck_oracle.hf.load import causal_lm


def main() -> None:
    folder, tokens = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    model = causal_lm(folder)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    logits = out.logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    print(json.dumps({
        "class": type(model).__name__,
        "argmax": logits.argmax(-1).tolist(),
        "entropy": entropy.tolist(),
        "ln_vocab": math.log(logits.shape[-1]),
        "finite": bool(torch.isfinite(logits).all()),
        # hidden_states[0] is the embedding output, [k] the residual stream after layer k-1.
        "absmax_after_layer": [float(h.abs().max()) for h in out.hidden_states[1:]],
    }))


if __name__ == "__main__":
    main()
