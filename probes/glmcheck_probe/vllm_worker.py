"""A vLLM worker extension (`LLM(..., worker_extension_cls="glmcheck_probe.vllm_worker.ProbeWorker")`)
that puts the probe in each tensor-parallel worker through vLLM's public `collective_rpc`:

    llm.collective_rpc("glmcheck_install", args=(out_dir, source))
    llm.generate(...)                       # the first forward is recorded
    llm.collective_rpc("glmcheck_finish")

Each worker writes `out_dir/rank{r}.trace`; `vllm_capture` merges them. The shard manifests are
written earlier, as the weights are loaded, by glmcheck's vLLM plugin (`vllm_plugin`).
"""

import json
import os

from . import vllm_plugin, vllm_probe


class ProbeWorker:
    """Mixed into vLLM's worker class by vLLM itself; methods prefixed `glmcheck_` so that none
    shadows a worker's own."""

    def _glmcheck_model(self):
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        return getattr(model, "module", model)

    def _glmcheck_rank(self):
        from vllm.distributed import (get_tensor_model_parallel_rank,
                                      get_tensor_model_parallel_world_size)

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()

    def glmcheck_install(self, out_dir: str, source: str = None, full=None) -> dict:
        """Hook the model for the next forward; `refused` says why not (a module or parameter
        the probe does not know), for the worker must go on serving. `full`: globs of stages
        kept whole, a list or (through vLLM's HTTP `/collective_rpc`, which passes strings)
        its JSON; `shards`: where glmcheck's plugin wrote this rank's manifest, if it did."""
        model = self._glmcheck_model()
        rank, tp = self._glmcheck_rank()
        os.makedirs(out_dir, exist_ok=True)
        if isinstance(full, str):
            full = json.loads(full) if full else None
        shards_dir = os.environ.get(vllm_plugin.SHARDS_ENV)
        shards = os.path.join(shards_dir, f"shards.rank{rank}.json") if shards_dir else None
        try:
            self._glmcheck_probe = vllm_probe.install(
                model, out_dir, rank, tp, full=tuple(full or vllm_probe.ENGINE_FULL),
                source=source or None)
        except vllm_probe.UnknownModel as e:
            return {"rank": rank, "tp": tp, "refused": str(e), "shards": shards}
        return {"rank": rank, "tp": tp, "shards": shards}

    def glmcheck_finish(self) -> dict:
        """Write the recorded trace; its folder and stage count."""
        probe = getattr(self, "_glmcheck_probe", None)
        if probe is None:
            raise RuntimeError("glmcheck_finish: glmcheck_install was not called on this worker")
        manifest = probe.finish()
        return {"rank": probe.rank, "trace": probe.dir, "stages": len(manifest["stages"])}
