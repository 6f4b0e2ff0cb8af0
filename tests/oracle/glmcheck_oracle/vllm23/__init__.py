"""vLLM 0.23, the last vLLM with GGUF in its tree, loading and running a glm-dsa GGUF through its
own classes at tensor parallelism N on its CPU build (`run_ranks`), with the user's loader patch
(`glm_dsa_load`), CPU platform shims (`cpu_shims`) and torch stand-ins for its GPU kernels
(`gpu_stand_ins`). Run with .venv-vllm's interpreter (`scripts/setup-vllm`)."""
