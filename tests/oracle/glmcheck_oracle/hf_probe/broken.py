"""Run the transformers probe on a model with one module deliberately broken, as an engine bug
would break it; transformers' files are not touched, the patch lives in this process only.

Usage: python -m glmcheck_oracle.hf_probe.broken BREAK MODEL_DIR --tokens IDS --out TRACE
                                                  [probe options]
  rope-neox       the rotary embedding rotates NeoX halves (x_i, x_{i+d/2}) instead of GLM-5's
                  interleaved pairs (x_2i, x_2i+1), in the attention and the indexer
  router-no-bias  every MoE router's e_score_correction_bias is left at zero after loading, as
                  a loader that drops the parameter does
"""

import sys

import torch
from glmcheck_probe import transformers_probe
from glmcheck_probe.transformers_probe import hf


def neox_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Rotate halves: pair i is (x_i, x_{i+d/2}), each with the angle of frequency i."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)

    def rotate(x):
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    return rotate(q), rotate(k)


class DroppedBias:
    """`AutoModelForCausalLM` whose loaded routers have their correction bias zeroed."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        model = DroppedBias.__wrapped__.from_pretrained(*args, **kwargs)
        routers = [m for m in model.modules() if isinstance(m, hf.GlmMoeDsaTopkRouter)]
        assert routers and any(r.e_score_correction_bias.abs().max() > 0 for r in routers), \
            "the model's routers carry no correction bias to drop"
        for r in routers:
            r.e_score_correction_bias.zero_()
        return model


def main():
    which, sys.argv = sys.argv[1], [sys.argv[0]] + sys.argv[2:]
    if which == "rope-neox":
        hf.apply_rotary_pos_emb_interleave = neox_rope
    elif which == "router-no-bias":
        DroppedBias.__wrapped__ = transformers_probe.AutoModelForCausalLM
        transformers_probe.AutoModelForCausalLM = DroppedBias
    else:
        sys.exit(f"hf_probe.broken: unknown break {which!r} (rope-neox, router-no-bias)")
    transformers_probe.main()


if __name__ == "__main__":
    main()
