"""The transformers probe's tensor-parallel recording (`transformers_probe.record` at tp > 1) on
CPU, without transformers' own TP loader (it needs `accelerate` and a GPU backend).

Usage: python -m glmcheck_oracle.hf_probe.tp_ranks MODEL_DIR TOKENS OUT_TRACE TP DTYPE
                                                    [swap-q-shards | shift-kv-heads]

Starts TP processes joined by gloo. Each loads the model whole, then keeps only its contiguous
1/TP of the attention heads in `q_b_proj` and `kv_b_proj` (output rows) and `o_proj` (input
columns), with `o_proj`'s output summed over the ranks inside its forward, the layout
transformers' "colwise" / "rowwise" styles give those modules. The rest stays replicated. Every
rank then records the forward with the probe. `swap-q-shards` gives each rank the next rank's
`q_b_proj` rows: a wrong shard layout that the attention still runs with. `shift-kv-heads` cuts
every rank's `kv_b_proj` rows one head later (the last rank wraps to head 0): heads that are all
the model's, at the wrong offset.

Also checks `head_split` on a few shapes before starting.
"""

import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from glmcheck_probe import transformers_probe as tp_probe


def check_head_split():
    hs = tp_probe.head_split
    assert hs(3 * 8 * 5, 3, 8, 5, 1, 0) == (8, None)
    assert hs(3 * 8 * 5, 3, 8, 5, 2, 1) == (8, None)
    assert hs(3 * 4 * 5, 3, 8, 5, 2, 1) == (4, 1)
    assert hs(3 * 2 * 5, 3, 8, 5, 4, 3) == (2, 3)
    bad_shapes = [(60, 3, 8, 5, 1, 0), (45, 3, 8, 5, 2, 0), (121, 3, 8, 5, 2, 0)]
    for bad in bad_shapes:
        try:
            hs(*bad)
        except ValueError:
            continue
        raise AssertionError(f"head_split{bad} did not raise")
    assert tp_probe.stage_dims("L3.moe.routed", 2) == "t d"
    assert tp_probe.stage_dims("L3.moe.routed", 1) == "t d partial(tp)"
    assert tp_probe.stage_dims("L0.attn.q", 2) == "t h(tp) d"


def shard(model, rank: int, tp: int, plant: str) -> None:
    heads = model.config.num_attention_heads
    local = heads // tp

    def rows(lin, width, r, offset=0):
        picked = [(r * local + offset + i) % heads for i in range(local)]
        w = lin.weight.data.reshape(heads, width, -1)[picked]
        lin.weight = torch.nn.Parameter(w.reshape(local * width, -1).clone(), requires_grad=False)
        lin.out_features = local * width

    for layer in model.model.layers[: model.config.num_hidden_layers]:
        a = layer.self_attn
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        rows(a.q_b_proj, qk, (rank + 1) % tp if plant == "swap-q-shards" else rank)
        shift = 1 if plant == "shift-kv-heads" else 0
        rows(a.kv_b_proj, a.qk_nope_head_dim + a.v_head_dim, rank, shift)
        o = a.o_proj
        w = o.weight.data.reshape(o.out_features, heads, a.v_head_dim)
        w = w[:, rank * local:(rank + 1) * local]
        o.weight = torch.nn.Parameter(w.reshape(o.out_features, -1).clone(), requires_grad=False)
        o.in_features = local * a.v_head_dim
        forward = o.forward

        def reduced(x, forward=forward):
            y = forward(x)
            dist.all_reduce(y)
            return y

        o.forward = reduced


def run(rank, tp, port, model_dir, tokens, out, dtype, plant):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tp_probe.DTYPES[dtype]).eval()
        shard(model, rank, tp, plant)
        tp_probe.record(model, model_dir, tokens, out, ("**",), dtype, rank=rank, tp=tp,
                        barrier=dist.barrier, notes={"tp_plan": "emulated"})
    finally:
        dist.destroy_process_group()


def main():
    model_dir, tokens, out, tp, dtype = sys.argv[1:6]
    plant = sys.argv[6] if len(sys.argv) > 6 else ""
    if plant not in ("", "swap-q-shards", "shift-kv-heads"):
        sys.exit(f"unknown plant {plant!r}: swap-q-shards or shift-kv-heads")
    check_head_split()
    tokens = [int(t) for t in tokens.split(",")]
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.set_num_threads(1)
    mp.spawn(run, args=(int(tp), port, model_dir, tokens, out, dtype, plant), nprocs=int(tp))


if __name__ == "__main__":
    main()
