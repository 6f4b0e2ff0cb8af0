"""The hooks of the vLLM probe: `Probe` hooks one worker's model (module hooks, and wrapped
functions where vLLM 0.32's CUDA tree computes outside any module), names each output as a
docs/design.md §4 stage, and writes the stages of one forward as the rank's glmcheck trace.
`ENGINE_FULL` is what it keeps whole by default.
"""

import os
import sys

import torch

from .trace import DEFAULT_FULL, TraceWriter, fingerprint
from .vllm_model import (ATTENTION, COLUMN, CUDA_ATTENTION, CUDA_LAYER, CUDA_MODEL, DTYPES, EMBED,
                         FUSED_MOE, GATE, INDEXER, LAYER, LM_HEAD, LOGITS, MERGED, MLP, MODEL, MOE,
                         REPLICATED, RMS_NORM, ROPE, ROW, UnknownModel, _class, _config,
                         _model_dtype, _require, _vllm_version)

# Kept whole by default: the logits and the residual stream (layer outputs and `attn_resid`,
# where a residual add that weighs its inputs wrongly shows), the DSA top-k ids and the router's
# chosen experts and weights (a few numbers per token). Without the ids a near tie the engine
# broke otherwise cannot be told from a bug; without the weights' values, the order an engine
# lists a token's experts in (free, and flipped by a near tie between two chosen experts) reads
# as a difference in their statistics.
ENGINE_FULL = DEFAULT_FULL + ("L*.attn_resid", "L*.attn.index_topk", "L*.moe.topk_ids",
                              "L*.moe.topk_weights")


def _first(output):
    """A vLLM linear returns (output, bias); a fused-residual RMSNorm (output, residual)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class Probe:
    """The hooks installed in one worker and the trace they write (`out_dir/rank{r}.trace`)."""

    def __init__(self, model, out_dir: str, rank: int, world_size: int, full=ENGINE_FULL,
                 source: str = None):
        self.model, self.rank, self.tp = model, int(rank), int(world_size)
        self.cfg = _config(model)
        self.dir = os.path.join(out_dir, f"rank{self.rank}.trace")
        self.full, self.source = full, source
        self.writer, self.tokens, self.done = None, None, False
        self.layer, self.in_indexer, self.hooks = None, False, []
        self.cuda_tree = False
        self.notes, self._ropes, self.expected = [], [], ["embed", "final_norm", "logits"]
        self._last_logits = None
        self.dtype = DTYPES[_model_dtype(model)]

    # -- recording ----------------------------------------------------------------------------

    def _start(self, input_ids) -> None:
        if self.done:
            return
        if self.writer is not None:
            # A second forward (a decode step) ends the recording.
            self.finish()
            return
        ids = input_ids.detach().reshape(-1).cpu().tolist()
        self.tokens = [int(t) for t in ids]
        source = self.source or str(getattr(self.cfg, "_name_or_path", ""))
        config = _config_dict(self.cfg)
        header = {
            "producer": {"name": "glmcheck_probe", "engine": "vllm", "vllm": _vllm_version(),
                         "torch": torch.__version__, "rank": self.rank, "world_size": self.tp,
                         "notes": self.notes},
            "model": {"source": source, "config": config,
                      "fingerprint": fingerprint(source, config) if os.path.isdir(source) else ""},
            "tokens": self.tokens, "backend": "vllm", "dtype": self.dtype, "tp": self.tp,
        }
        self.writer = TraceWriter(self.dir, header, self.full)

    @property
    def active(self) -> bool:
        return self.writer is not None and not self.done

    def take(self, name: str, tensor, dims: str, *tail: int, split: bool = False,
             held: float = 1.0) -> None:
        """Record `tensor` as stage `name` [T, *tail]; `split` marks this rank's part; `held`:
        the factor by which vLLM holds the values below the reference's units."""
        if not self.active:
            return
        # A copy: vLLM works in place after the hook (RoPE rotates q's rope part inside
        # `q_b_proj`'s output; the indexer's top-k buffer is reused by every layer), and on a
        # CPU `.cpu()` returns the tensor itself.
        x = tensor.detach().cpu().clone()
        x = x.to(torch.float32) * held if x.is_floating_point() else x.to(torch.int32)
        x = x.reshape(len(self.tokens), *tail).numpy()
        rank = self.rank if split and self.tp > 1 else None
        self.writer.record(name, x, dims, rank)

    def finish(self) -> dict:
        """Write the trace and remove the hooks; the manifest. Raises when the forward recorded
        no stage (vLLM ran a compiled graph or CUDA graph the hooks do not see)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.done:
            return self.writer.manifest
        if self.writer is None:
            raise RuntimeError(f"rank {self.rank}: no forward ran through the hooked modules; "
                               "run vLLM with enforce_eager=True so hooks see the forward")
        recorded = {s["name"] for s in self.writer.manifest["stages"] + self.writer.stages}
        missing = [name for name in self.expected if name not in recorded]
        if missing:
            note = ("not recorded (the forward did not run these modules, or computed logits at "
                    "the sampled position only: ask for prompt log-probabilities): "
                    f"{', '.join(missing)}")
            self.notes.append(note)
            print(f"glmcheck_probe: rank {self.rank}: {note}", file=sys.stderr)
        manifest = self.writer.finish()
        self.done = True
        if len(manifest["stages"]) <= 1:
            raise RuntimeError(f"{self.dir}: the forward recorded {len(manifest['stages'])} "
                               "stage(s); run vLLM with enforce_eager=True")
        return manifest

    # -- hooks --------------------------------------------------------------------------------

    def _out(self, module, fn):
        self.hooks.append(module.register_forward_hook(lambda _m, args, out: fn(out)))

    def _pre(self, module, fn):
        self.hooks.append(module.register_forward_pre_hook(lambda _m, args: fn(args)))

    def _wrap(self, owner, method: str, fn):
        """`fn(result, args, kwargs)` after each call of `owner.method` (a function of a Python
        module, or a method of an object that is not a torch module)."""
        self.hooks.append(_Wrapped(owner, method, fn))

    def _routes(self, L: str, out, scale: float) -> None:
        """The router's (topk_weights, topk_ids), the weights times `scale` where vLLM applies
        routed_scaling_factor to the output instead: the reference's weights include it."""
        weights, ids = out
        self.take(L + "moe.topk_ids", ids, "t k", -1)
        self.take(L + "moe.topk_weights", weights, "t k", -1, held=scale)

    def install(self) -> "Probe":
        cfg, model = self.cfg, self.model
        _require("model", getattr(model, "model", None), MODEL | CUDA_MODEL)
        inner = model.model
        self.cuda_tree = _class(inner) in CUDA_MODEL
        _require("model.embed_tokens", getattr(inner, "embed_tokens", None), EMBED)
        _require("model.norm", getattr(inner, "norm", None), RMS_NORM)
        # The forward starts at the embedding: `DeepseekV2Model` is wrapped by vLLM's
        # `support_torch_compile`, whose `__call__` runs `forward` directly when not compiling,
        # so hooks on the model itself never fire.
        self._pre(inner.embed_tokens, lambda args: self._start(args[0]))
        self._out(inner.embed_tokens, lambda o: self.take("embed", _first(o), "t d", -1))
        layers = getattr(inner, "layers", None)
        if layers is None or len(layers) < cfg.num_hidden_layers:
            raise UnknownModel(f"model.layers: {0 if layers is None else len(layers)} layers "
                               f"for num_hidden_layers {cfg.num_hidden_layers}")
        for n in range(cfg.num_hidden_layers):
            self._layer(n, layers[n])
        if self.cuda_tree:
            self._cuda_functions(inner, layers[:cfg.num_hidden_layers])
        else:
            self._out(inner.norm, lambda o: self.take("final_norm", _first(o), "t d", -1))
        logits = getattr(model, "logits_processor", None)
        _require("lm_head", getattr(model, "lm_head", None), LM_HEAD)
        _require("logits_processor", logits, LOGITS)
        self._out(logits, self._logits)
        return self

    def _cuda_functions(self, inner, layers) -> None:
        """The CUDA tree computes its norms and rotations in module-level functions, where no
        module hook fires: the probe wraps them in the tree's own modules. Each RMSNorm after
        the first layer's input runs in `fused_allreduce_rms_norm`, which all-reduces the
        previous block's partial output, adds the residual and normalizes: its residual is
        the stream's stage before the norm (a layer's `out`, or its `attn_resid`)."""
        if any(getattr(layer, "use_sequence_parallel", False) for layer in layers):
            raise UnknownModel("model.layers: sequence-parallel MoE (use_sequence_parallel_moe) "
                               "shards the residual stream by token; the probe reads it whole")
        model_fns = sys.modules[type(inner).__module__]
        attn_fns = sys.modules[type(layers[0].self_attn).__module__]
        for owner, name in ((model_fns, "fused_embed_norm"),
                            (model_fns, "fused_allreduce_rms_norm"),
                            (attn_fns, "fused_norm_rope"), (attn_fns, "fused_q"),
                            (attn_fns, "sparse_attn_indexer")):
            if not callable(getattr(owner, name, None)):
                raise UnknownModel(f"{owner.__name__}.{name}: missing; the probe knows vLLM "
                                   "0.32's CUDA tree")
        last = len(layers) - 1
        norms = {id(inner.norm): ("final_norm", f"L{last}.out")}
        for n, layer in enumerate(layers):
            if n:
                norms[id(layer.input_layernorm)] = (f"L{n}.attn_norm", f"L{n - 1}.out")
            norms[id(layer.post_attention_layernorm)] = (f"L{n}.ffn_norm", f"L{n}.attn_resid")
        self._out(layers[0].input_layernorm, lambda o: self.take("L0.attn_norm", o, "t d", -1))

        def embed_norm(out, args, kwargs):
            self._start(args[0])
            rows, normed = out if isinstance(out, tuple) else (out, None)
            self.take("embed", rows, "t d", -1)
            if normed is not None:
                self.take("L0.attn_norm", normed, "t d", -1)

        def allreduce_norm(out, args, kwargs):
            norm = args[2] if len(args) > 2 else kwargs.get("norm")
            stages = norms.get(id(norm))
            if stages is None:
                raise UnknownModel("fused_allreduce_rms_norm: called with a norm that is not a "
                                   "layer's input or post-attention norm, or the final norm")
            # The residual first: it closes the layer before (the trace is written by layer).
            self.take(stages[1], out[1], "t d", -1)
            self.take(stages[0], out[0], "t d", -1)

        def norm_rope(out, args, kwargs):
            L = f"L{self.layer}."
            self.take(L + "attn.q_a_norm", out, "t d", -1)
            for key, stage in (("kv_c_out", "attn.kv_a_norm"), ("k_pe_out", "attn.k_rope")):
                if kwargs.get(key) is not None:
                    self.take(L + stage, kwargs[key], "t d", -1)

        def q_rope(out, args, kwargs):
            mqa_q = out[2]
            if mqa_q.is_floating_point() and mqa_q.element_size() > 1:
                heads = self.cfg.num_attention_heads // self.tp
                self.take(f"L{self.layer}.attn.q_rope", mqa_q, "t h(tp) d", heads, -1,
                          split=True)

        def top_k(out, args, kwargs):
            buffer = args[13] if len(args) > 13 else kwargs["topk_indices_buffer"]
            self._index_topk(f"L{self.layer}.", buffer)

        self._wrap(model_fns, "fused_embed_norm", embed_norm)
        self._wrap(model_fns, "fused_allreduce_rms_norm", allreduce_norm)
        self._wrap(attn_fns, "fused_norm_rope", norm_rope)
        self._wrap(attn_fns, "fused_q", q_rope)
        self._wrap(attn_fns, "sparse_attn_indexer", top_k)

    def _logits(self, out) -> None:
        """vLLM computes logits at the sampled position (the prompt's last) and, when the
        request asks for prompt log-probabilities, at every earlier position in a second call
        (`gpu_model_runner.py` `_get_prompt_logprobs_dict`): the two are put together into the
        prompt's logits. A call with a row per token is recorded as it is."""
        if not self.active or out is None:
            return
        t = len(self.tokens)
        rows = out.shape[0] if out.dim() == 2 else -1
        if rows == t:
            self.take("logits", out, "t v(tp)", -1)
            self.finish()
        elif rows == 1 and self._last_logits is None:
            self._last_logits = out.detach().clone()
        elif rows == t - 1 and self._last_logits is not None:
            self.take("logits", torch.cat([out, self._last_logits.to(out.dtype)]), "t v(tp)", -1)
            self.finish()
        else:
            self.notes.append(f"logits: {rows} rows for {t} tokens; not recorded")

    def _layer(self, n: int, layer) -> None:
        at, cfg, cuda = f"model.layers.{n}", self.cfg, self.cuda_tree
        _require(at, layer, CUDA_LAYER if cuda else LAYER)
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        _require(f"{at}.self_attn", attn, CUDA_ATTENTION if cuda else ATTENTION)
        L = f"L{n}."
        # The CPU tree's fp16 guard holds the residual stream divided by routed_scaling_factor
        # (`DeepseekV2DecoderLayer.forward`; a MoE layer's output through the MoE runner's
        # `_maybe_apply_routed_scale_to_output`): recorded in the reference's units.
        fp16_guard = self.dtype == "f16" and not cuda
        held = float(getattr(cfg, "routed_scaling_factor", 1.0)) if fp16_guard else 1.0
        # Without a q LoRA (DeepSeek-V2-Lite) `q_proj` makes the query from the hidden state.
        q_lora = bool(getattr(cfg, "q_lora_rank", None))
        self.expected += [L + s for s in (
            "attn_norm", "attn.q_a", "attn.kv_a", "attn.q_a_norm", "attn.q", "attn.kv_a_norm",
            "attn.q_rope", "attn.k_rope", "attn.ctx", "attn.out", "attn_resid",
            "ffn_norm", "ffn.out", "out") if q_lora or not s.startswith("attn.q_a")]
        heads = cfg.num_attention_heads // self.tp
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self._pre(layer, lambda _a: setattr(self, "layer", n))
        _require(f"{at}.input_layernorm", getattr(layer, "input_layernorm", None), RMS_NORM)
        if not cuda:  # the CUDA tree's norms: `_cuda_functions`
            self._out(layer.input_layernorm,
                      lambda o: self.take(L + "attn_norm", _first(o), "t d", -1))

        fused = getattr(attn, "fused_qkv_a_proj", None)
        if fused is not None:
            _require(f"{at}.self_attn.fused_qkv_a_proj", fused, MERGED)
            rank = cfg.q_lora_rank

            def qkv_a(o):
                o = _first(o)
                self.take(L + "attn.q_a", o[..., :rank], "t d", -1)
                self.take(L + "attn.kv_a", o[..., rank:], "t d", -1)

            self._out(fused, qkv_a)
        else:
            a_projs = (("q_a_proj", "attn.q_a"),) if q_lora else ()
            for name, stage in a_projs + (("kv_a_proj_with_mqa", "attn.kv_a"),):
                mod = getattr(attn, name, None)
                _require(f"{at}.self_attn.{name}", mod, REPLICATED)
                self._out(mod, lambda o, s=stage: self.take(L + s, _first(o), "t d", -1))
        # kv_b_proj is hooked but not expected: vLLM's MLA absorbs it into W_UK_T and W_UV after
        # loading and does not call it in a forward. The CUDA tree's q_a and kv_a norms run in
        # `fused_norm_rope` (`_cuda_functions`), which only reads their weights.
        query = (
            ("q_a_layernorm", RMS_NORM, "attn.q_a_norm", "t d", (-1,), False),
            ("q_b_proj", COLUMN, "attn.q", "t h(tp) d", (heads, qk), True),
        ) if q_lora else (("q_proj", COLUMN, "attn.q", "t h(tp) d", (heads, qk), True),)
        for name, classes, stage, dims, tail, split in query + (
            ("kv_a_layernorm", RMS_NORM, "attn.kv_a_norm", "t d", (-1,), False),
            ("kv_b_proj", COLUMN, "attn.kv", "t h(tp) d", (heads, -1), True),
        ):
            mod = getattr(attn, name, None)
            _require(f"{at}.self_attn.{name}", mod, classes)
            if not (cuda and classes is RMS_NORM):
                self._out(mod, lambda o, s=stage, d=dims, t=tail, p=split:
                          self.take(L + s, _first(o), d, *t, split=p))

        rope = getattr(attn, "rotary_emb", None)
        _require(f"{at}.self_attn.rotary_emb", rope, ROPE)
        if not cuda and all(rope is not hooked for hooked in self._ropes):
            self._ropes.append(rope)
            self._out(rope, self._rope)
        indexer = getattr(attn, "indexer", None)
        if indexer is not None:
            _require(f"{at}.self_attn.indexer", indexer, INDEXER)
            self.expected.append(L + "attn.index_topk")
            if not cuda:  # the CUDA tree's top-k: `sparse_attn_indexer`, `_cuda_functions`
                self._pre(indexer, lambda _a: setattr(self, "in_indexer", True))

                def index(o):
                    self.in_indexer = False
                    self._index_topk(L, _first(o))

                self._out(indexer, index)
        o_proj = getattr(attn, "o_proj", None)
        _require(f"{at}.self_attn.o_proj", o_proj, ROW)
        self._pre(o_proj, lambda a: self.take(L + "attn.ctx", a[0], "t h(tp) d", heads, -1,
                                              split=True))
        reduced = getattr(o_proj, "reduce_results", True) or self.tp == 1
        self._out(o_proj, lambda o: self.take(L + "attn.out", _first(o),
                                              "t d" if reduced else "t d partial(tp)", -1,
                                              split=not reduced))
        post = getattr(layer, "post_attention_layernorm", None)
        _require(f"{at}.post_attention_layernorm", post, RMS_NORM)

        def post_norm(o):
            if not isinstance(o, (tuple, list)):
                raise UnknownModel(f"{at}.post_attention_layernorm: returned one tensor, not "
                                   "vLLM's (normed, residual) pair")
            self.take(L + "attn_resid", o[1], "t d", -1, held=held)
            self.take(L + "ffn_norm", o[0], "t d", -1)

        if not cuda:  # the CUDA tree's post-attention norm: `_cuda_functions`
            self._out(post, post_norm)
        if _class(mlp) in MOE:
            gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
            _require(f"{at}.mlp.gate", gate, GATE)
            _require(f"{at}.mlp.experts", experts, FUSED_MOE)
            self._out(gate, lambda o: self.take(L + "moe.router_logits", _first(o), "t e", -1))
            self.expected.append(L + "moe.router_logits")
            # The MoE runner routes through a router object: vLLM 0.32's `mlp.experts` is the
            # runner, 0.23's FusedMoE holds one (`runner`).
            runner = getattr(experts, "runner", experts)
            router = getattr(runner, "router", None)
            if router is not None:
                # The factor is in the weights (the router's own) or applied to the experts'
                # output by the runner (`apply_routed_scale_to_output`, the router's is 1).
                scale = 1.0 if getattr(router, "routed_scaling_factor", 1.0) != 1.0 else float(
                    getattr(runner, "routed_scaling_factor", 1.0))
                self._wrap(router, "select_experts",
                           lambda out, _args, _kwargs, s=scale: self._routes(L, out, s))
                self.expected += [L + "moe.topk_ids", L + "moe.topk_weights"]
            shared = getattr(mlp, "shared_experts", None)
            if shared is not None:
                _require(f"{at}.mlp.shared_experts", shared, MLP)
                down = getattr(shared, "down_proj", None)
                _require(f"{at}.mlp.shared_experts.down_proj", down, ROW)
                partial = not getattr(down, "reduce_results", True) and self.tp > 1
                self.expected.append(L + "moe.shared")
                self._out(shared, lambda o, partial=partial: self.take(
                    L + "moe.shared", _first(o), "t d partial(tp)" if partial else "t d", -1,
                    split=partial))
        else:
            _require(f"{at}.mlp", mlp, MLP | MOE)
        moe_held = held if _class(mlp) in MOE else 1.0
        # The CUDA tree leaves the block's output un-reduced: the all-reduce runs in the next
        # norm, `fused_allreduce_rms_norm`, which also gives the layer's output.
        unreduced = cuda and self.tp > 1
        self._out(mlp, lambda o: self.take(L + "ffn.out", _first(o),
                                           "t d partial(tp)" if unreduced else "t d", -1,
                                           split=unreduced, held=moe_held))
        if cuda:
            return

        def out(o):
            if not (isinstance(o, (tuple, list)) and len(o) == 2):
                raise UnknownModel(f"{at}: returned {type(o).__name__}, not vLLM's "
                                   "(hidden_states, residual)")
            self.take(L + "out", o[0] + o[1], "t d", -1, held=held)

        self._out(layer, out)

    def _index_topk(self, L: str, ids) -> None:
        """The DSA top-k of the prompt's tokens; keys after the query are padding of a short
        prompt: -1, as docs/design.md §4 says."""
        ids = ids[: len(self.tokens)].to(torch.int64)
        query = torch.arange(len(self.tokens)).unsqueeze(-1)
        self.take(L + "attn.index_topk", torch.where(ids > query, -1, ids), "t k", -1)

    def _rope(self, out) -> None:
        """MLA's rotary call records the rotated parts; the indexer's (same module object in
        vLLM's rope cache) is told apart by the indexer's pre/post hooks."""
        if self.in_indexer or not self.active:
            return
        q, k = out
        cfg, L = self.cfg, f"L{self.layer}."
        rope = cfg.qk_rope_head_dim
        heads = cfg.num_attention_heads // self.tp
        self.take(L + "attn.q_rope", q[..., -rope:], "t h(tp) d", heads, rope, split=True)
        self.take(L + "attn.k_rope", k[..., -rope:], "t d", rope)


class _Wrapped:
    """A method of one object wrapped to call `fn` on its result; `remove()` undoes it, as a
    module hook's handle does."""

    def __init__(self, owner, method: str, fn):
        self.owner, self.method = owner, method
        self.real = real = getattr(owner, method)
        # A module's function is put back; an object's bound method is its class's again.
        self.own = method in vars(owner)

        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            fn(out, args, kwargs)
            return out

        setattr(owner, method, wrapped)

    def remove(self) -> None:
        if self.own:
            setattr(self.owner, self.method, self.real)
        else:
            self.owner.__dict__.pop(self.method, None)


def _config_dict(cfg) -> dict:
    if isinstance(cfg, dict):
        return cfg
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    return {k: v for k, v in vars(cfg).items() if not k.startswith("_")}
