"""Stand-ins for the `sglang.*` modules (and `zmq`) that SGLang 0.5.23's `dumper.py` imports,
so that the real, unmodified file from the pinned wheel runs here without SGLang (which needs a
GPU). They hold exactly what the dumper reads: the import-time names (dumper.py:23-31), the
classes `_SGLangPlugin` tests values against (dumper.py:1709-1717, 1783-1784) and the
`get_parallel()` fields it records as `sglang_parallel_info` (dumper.py:1724-1758). The
classes the model passes to the hooks are these same ones, so the plugin converts them as it
converts SGLang's own.
"""

import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from typing import List, Optional

import torch

# Where the pinned dumper is found when $GLMCHECK_SGLANG_DUMPER is unset: the copy
# scripts/setup-sglang-dumper extracts from the sglang==0.5.23 wheel.
SGLANG_VERSION = "0.5.23"
_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
DEFAULT_DUMPER = os.path.join(_REPO, ".oracles", f"sglang-{SGLANG_VERSION}", "dumper.py")
# SGLang's older dump mechanism (--debug-tensor-dump-output-folder), from the same wheel;
# $GLMCHECK_SGLANG_TENSOR_HOOK overrides.
DEFAULT_TENSOR_HOOK = os.path.join(_REPO, ".oracles", f"sglang-{SGLANG_VERSION}",
                                   "tensor_dump_forward_hook.py")


@dataclass
class ForwardBatch:
    """The fields of sglang.srt.model_executor.forward_batch_info.ForwardBatch that the dumper
    dumps under their plain names (dumper.py:1767-1777), plus the per-forward state the model
    keeps on it as SGLang does (`residual_stream`) and this fixture's KV cache."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    rids: Optional[List[str]] = None
    residual_stream: object = None
    kv_cache: dict = field(default_factory=dict)


@dataclass
class PPProxyTensors:
    tensors: dict


@dataclass
class LogitsProcessorOutput:
    """sglang.srt.layers.logits_processor.LogitsProcessorOutput: the dumper keeps only
    `next_token_logits` (dumper.py:1766)."""

    next_token_logits: torch.Tensor


@dataclass
class UnreducedOutput:
    """layer_boundary/output.py: a partial sum still owed; the dumper dumps `.partial`."""

    partial: torch.Tensor


@dataclass
class Contribution:
    value: Optional[torch.Tensor]


@dataclass(frozen=True)
class OwedOutput:
    """layer_boundary/residual/stream.py:80: the handle a decoder layer returns when its FFN
    all-reduce is deferred to the next layer's input; the dumper dumps
    `.contribution.value`, this rank's partial sum (dumper.py:1789-1791)."""

    contribution: Contribution


@dataclass(frozen=True)
class Parallel:
    """runtime_context.get_parallel() of a single-node TP run: no PP, EP, DP attention or CP,
    so attention TP and MoE TP are the TP group."""

    tp_rank: int
    tp_size: int
    pp_rank: int = 0
    pp_size: int = 1
    moe_ep_rank: int = 0
    moe_ep_size: int = 1
    moe_dp_rank: int = 0
    attn_dp_rank: int = 0
    attn_dp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1

    @property
    def moe_tp_rank(self):
        return self.tp_rank

    @property
    def moe_tp_size(self):
        return self.tp_size

    @property
    def attn_tp_rank(self):
        return self.tp_rank

    @property
    def attn_tp_size(self):
        return self.tp_size


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _unused(name):
    def fail(*_args, **_kwargs):
        raise NotImplementedError(f"{name}: the dumper's HTTP control is not stood in")

    return fail


def install(tp_rank: int, tp_size: int) -> None:
    """Put the stand-ins into sys.modules for a rank of a TP `tp_size` run."""
    parallel = Parallel(tp_rank=tp_rank, tp_size=tp_size)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.layers",
                 "sglang.srt.model_executor", "sglang.srt.debug_utils",
                 "sglang.srt.layers.layer_boundary",
                 "sglang.srt.layers.layer_boundary.residual"):
        _module(name, __path__=[])
    _module("sglang.srt.managers.io_struct", sock_recv=_unused("sock_recv"),
            sock_send=_unused("sock_send"), wrap_as_pickle=_unused("wrap_as_pickle"))
    _module("sglang.srt.runtime_context", get_parallel=lambda: parallel,
            get_server_args=lambda: None, get_serving=_unused("get_serving"))
    _module("sglang.srt.utils", get_device=lambda: "cpu")
    _module("sglang.srt.distributed")
    _module("sglang.srt.layers.dp_attention", is_dp_attention_enabled=lambda: False,
            get_moe_cp_size=lambda: 1)
    _module("sglang.srt.layers.logits_processor", LogitsProcessorOutput=LogitsProcessorOutput)
    _module("sglang.srt.model_executor.forward_batch_info", ForwardBatch=ForwardBatch,
            PPProxyTensors=PPProxyTensors)
    _module("sglang.srt.layers.layer_boundary.output", UnreducedOutput=UnreducedOutput)
    _module("sglang.srt.layers.layer_boundary.residual.stream", OwedOutput=OwedOutput)
    if importlib.util.find_spec("zmq") is None:
        # Used only by the dumper's HTTP control (DUMPER_SERVER_PORT), which stays off.
        _module("zmq")


def load_dumper(path: Optional[str] = None):
    """Import the pinned dumper.py as `sglang.srt.debug_utils.dumper` (its own module name,
    which its docstrings and `source_patcher` use) and return its `dumper` singleton. The
    DUMPER_* environment must be set first: the singleton reads it at import."""
    path = path or os.environ.get("GLMCHECK_SGLANG_DUMPER") or DEFAULT_DUMPER
    if not os.path.isfile(path):
        raise SystemExit(f"SGLang's dumper.py not found at {path}: run scripts/setup-venv "
                         "(scripts/setup-sglang-dumper) or set GLMCHECK_SGLANG_DUMPER")
    name = "sglang.srt.debug_utils.dumper"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    sys.modules["sglang.srt.debug_utils"].dumper = module
    return module.dumper


def load_tensor_hook(path: Optional[str] = None):
    """Import the pinned tensor_dump_forward_hook.py as
    `sglang.srt.debug_utils.tensor_dump_forward_hook` (it imports LogitsProcessorOutput,
    ForwardBatch and PPProxyTensors from the stand-ins, so `install` first) and return the
    module; SGLang calls its `register_forward_hook_for_model`."""
    path = path or os.environ.get("GLMCHECK_SGLANG_TENSOR_HOOK") or DEFAULT_TENSOR_HOOK
    if not os.path.isfile(path):
        raise SystemExit(f"SGLang's tensor_dump_forward_hook.py not found at {path}: run "
                         "scripts/setup-venv (scripts/setup-sglang-dumper) or set "
                         "GLMCHECK_SGLANG_TENSOR_HOOK")
    name = "sglang.srt.debug_utils.tensor_dump_forward_hook"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    sys.modules["sglang.srt.debug_utils"].tensor_dump_forward_hook = module
    return module
