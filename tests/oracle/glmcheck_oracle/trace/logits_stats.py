"""torch's view of two traces' logits:
`python -m glmcheck_oracle.trace.logits_stats REF.trace CAND.trace` → JSON.

Entropy of the candidate's softmax per position (mean), top-1 probability (mean), and
KL(reference ‖ candidate) per position (mean, max) with torch.nn.functional.kl_div in float64.
"""

import glob
import json
import os
import sys

import torch
from safetensors.torch import load_file


def logits(trace: str) -> torch.Tensor:
    for f in glob.glob(os.path.join(trace, "*.safetensors")):
        tensors = load_file(f)
        if "logits" in tensors:
            return tensors["logits"].to(torch.float64)
    raise SystemExit(f"{trace}: no logits tensor")


def main() -> None:
    ref, cand = logits(sys.argv[1]), logits(sys.argv[2])
    lp_ref, lp_cand = ref.log_softmax(-1), cand.log_softmax(-1)
    entropy = -(lp_cand.exp() * lp_cand).sum(-1)
    kl = torch.nn.functional.kl_div(lp_cand, lp_ref, reduction="none", log_target=True).sum(-1)
    print(json.dumps({
        "entropy_mean": entropy.mean().item(),
        "top1_prob_mean": lp_cand.exp().max(-1).values.mean().item(),
        "kl_mean": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agreement": (ref.argmax(-1) == cand.argmax(-1)).double().mean().item(),
    }))


if __name__ == "__main__":
    main()
