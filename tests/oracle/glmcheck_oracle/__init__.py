"""glmcheck's test oracles: the programs the Rust integration tests (tests/*/) run as
`python -m glmcheck_oracle.GROUP.MODULE ARGS...` (`tests/common/mod.rs` `run_oracle`) to get
an independent answer from another implementation, or to make a model or plant a bug.

* `formats`: GGUF and safetensors files through gguf-py, numpy and safetensors (writing,
  listing, quantizing, dequantizing, comparing, planting faults, shard manifests);
* `trace`: glmcheck traces re-read and recomputed with numpy and torch;
* `hf`: transformers running, saving and tokenizing Hugging Face folders;
* `hf_probe`: the transformers probe (`glmcheck_probe`) recording a model with a bug planted,
  or at tensor parallelism (gloo ranks on CPU; transformers' own TP plan under torchrun);
* `llamacpp`: tiny GLM-5s converted and quantized by llama.cpp's own tools;
* `vllm23`: a glm-dsa GGUF loaded and run by vLLM 0.23's classes, one process per rank;
* `vllm32`: bugs planted inside vLLM 0.32, as a vLLM plugin.

scripts/setup-venv installs this package (editable, with `glmcheck_probe`) into .venv, and
scripts/setup-vllm into the vLLM venvs; the modules import each other and the probe as
installed packages.
"""
