"""The transformers probe under transformers' TP plan with a TP bug planted (GPU machine, torchrun).

Usage: torchrun --nproc-per-node 2 -m glmcheck_oracle.hf_probe.tp_planted MODEL_DIR
                                                                       [probe options ...]

Same as `python -m glmcheck_probe.transformers_probe MODEL_DIR --tp-plan auto ...`, except that
after loading, the last rank's shard of layer 0's `kv_b_proj` holds its heads in the wrong order
(rolled by one head): a wrong shard layout that still runs. bisect should stop at `L0.attn.kv`.
"""

import sys

import torch
import torch.distributed as dist

from glmcheck_probe import transformers_probe as tp_probe

load = tp_probe.AutoModelForCausalLM.from_pretrained


def planted(*args, **kwargs):
    model = load(*args, **kwargs)
    if dist.get_rank() == dist.get_world_size() - 1:
        attn = model.model.layers[0].self_attn
        w = attn.kv_b_proj.weight
        local = w.to_local() if hasattr(w, "to_local") else w
        width = attn.qk_nope_head_dim + attn.v_head_dim
        with torch.no_grad():
            before = local[0, :4].tolist()
            local.copy_(local.roll(width, dims=0))
            print(f"planted: rank {dist.get_rank()} kv_b_proj local {tuple(local.shape)} rolled by "
                  f"{width} rows; row 0 {before} -> {local[0, :4].tolist()}", file=sys.stderr)
    return model


class Loader:
    from_pretrained = staticmethod(planted)


def main() -> None:
    tp_probe.AutoModelForCausalLM = Loader
    sys.argv[0] = "glmcheck_probe.transformers_probe"
    tp_probe.main()


if __name__ == "__main__":
    main()
