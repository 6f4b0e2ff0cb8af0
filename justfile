# Tasks of the glmcheck crate; `just --list` shows them.

# Every test, the Python oracles set up first (arguments go to `cargo test`).
test *ARGS:
    scripts/test {{ARGS}}

# Build the llama.cpp oracle into .oracles/llama.cpp (`just test` does it too).
setup-llamacpp:
    scripts/setup-llamacpp

# Build the llama.cpp probe (probes/llamacpp) against the oracle's llama.cpp, or the tree
# LLAMA_CPP_DIR names (LLAMA_CPP_BUILD: its static build); the binary lands in
# .oracles/llamacpp-probe/build/.
llamacpp-probe:
    scripts/setup-llamacpp
    scripts/setup-llamacpp-probe

# glmcheck against llama.cpp and transformers on a converter-made F32 GGUF, with the numbers.
llamacpp-oracle:
    scripts/setup-venv
    scripts/setup-llamacpp
    GLMCHECK_PYTHON="$PWD/.venv/bin/python" cargo test --test llamacpp llamacpp_oracle:: -- --nocapture

# Dequantization throughput of glmcheck, candle and gguf-py (bench-results/dequant.md); the
# few-token GEMM kernel against gemm's (bench-results/gemm.md); then the
# reference executor against transformers on `small`, and its peak memory on glm5-dims with 2 and 6
# layers (bench-results/reference.md); `verify` GB/s and peak RSS on glm5-dims with 2 and 4 layers
# (bench-results/verify.md); bisect's check of an engine's file, on the path or whole, on glm5-dims
# (bench-results/path-check.md); endpoint --explain's seconds per hypothesis on glm5-dims against a
# local server answering as vLLM with a planted fault, and the full GLM-5 on paper
# (bench-results/explain.md). Writes and deletes multi-GB files in the temp dir.
bench:
    scripts/setup-venv
    cargo bench --bench dequant
    cargo bench --bench gemm
    cargo build --release
    .venv/bin/python benches/reference.py
    .venv/bin/python benches/verify.py
    .venv/bin/python benches/path_check.py
    .venv/bin/python benches/explain.py

# The demo: a tiny synthetic GLM-5 GGUF inspected, then a TP=4 candidate with a planted fault bisected.
demo:
    cargo run --release -- demo

# Rewrite golden/'s gate baselines from this build (tiny and small, f32 and bf16, TP 1/2/4); review the diff.
golden:
    scripts/gate-golden --update

# Gate this build against golden/ (what .ci/run does after the tests).
gate-golden:
    scripts/gate-golden

# Fuzz a target (gguf_header, safetensors_header, trace_manifest, shard_manifest, sglang_dump) for SECONDS; needs nightly and cargo-fuzz (fuzz/README.md).
fuzz target="gguf_header" seconds="300":
    scripts/setup-venv
    .venv/bin/python fuzz/make_seeds.py
    cd fuzz && cargo +nightly fuzz run {{target}} -- -max_total_time={{seconds}}

# The fuzz targets built for a many-core machine (release, no sanitizer: the AddressSanitizer
# build takes over an hour on 2 cores), stripped into target/device/fuzz-bin, seeds beside them.
fuzz-build:
    scripts/setup-venv
    .venv/bin/python fuzz/make_seeds.py
    cd fuzz && cargo +nightly fuzz build -s none --release
    mkdir -p target/device/fuzz-bin target/device/seeds
    for t in gguf_header safetensors_header trace_manifest shard_manifest; do strip -o target/device/fuzz-bin/$t fuzz/target/x86_64-unknown-linux-gnu/release/$t; done
    cp -r fuzz/corpus/. target/device/seeds/

# Every fuzz target at once, SECONDS each over FORKS processes: fuzz/README.md's figures
# (target/fuzz-figures/figures.md, crash inputs in target/fuzz-figures/artifacts/).
fuzz-figures seconds="530" forks="3":
    scripts/fuzz-figures target/device/fuzz-bin target/device/seeds target/fuzz-figures --seconds {{seconds}} --forks {{forks}}

# On the GPU machine (device tool): every mix's GPU dequantization against the CPU, bit for bit.
gpu-dequant-check:
    scripts/gpu/gpu-dequant-check target/release/glmcheck

# On the GPU machine: the CUDA backend's selftest, clean bisects against the CPU at TP 1/2/4 on
# tiny, small and glm5-dims, the reference on the GPU against the CPU's, the fault matrix at TP
# 2/4 (TP 1 on one GPU), per-rank GPU memory (writes OUT/gpu-backend.md).
gpu-backend-check out="target/gpu-backend":
    scripts/gpu/gpu-env scripts/gpu/gpu-backend-check target/release/glmcheck {{out}}

# On the GPU machine: one glm5-dims MoE block, glmcheck's CUDA backend against transformers' module in PyTorch.
gpu-moe-bench out="target/gpu-moe":
    scripts/gpu/gpu-env scripts/gpu/gpu-moe-bench target/release/glmcheck {{out}}

# On the GPU machine: glm5-dims' whole forward (4 layers) at 8/64/512 tokens, glmcheck's CUDA
# backend against transformers' eager model on the same GPU (writes OUT/gpu-forward.md). Name
# several builds (`just gpu-forward-bench target/gpu-forward before/glmcheck target/release/glmcheck`)
# to compare them run by run, every stage checked equal to the first build's.
gpu-forward-bench out="target/gpu-forward" +builds="target/release/glmcheck":
    scripts/gpu/gpu-env scripts/gpu/gpu-forward-bench {{builds}} {{out}}

# On a machine of several GPUs: the same forward at 512 tokens at TP 1, 2 and 4, each rank on a
# GPU of its own (TP sizes past the machine's GPU count are left out and named in the report).
gpu-forward-tp out="target/gpu-forward-tp" tp="1,2,4" +builds="target/release/glmcheck":
    scripts/gpu/gpu-env scripts/gpu/gpu-forward-bench {{builds}} {{out}} --tokens 512 --tp {{tp}}

# On the GPU machine: each build's GPU time per kernel group (Nsight Compute) in a glm5-dims
# forward of 2 layers at 512 tokens, per pass (writes OUT/kernel-times.md).
gpu-kernel-times out="target/gpu-kernels" +builds="target/release/glmcheck":
    scripts/gpu/gpu-env scripts/gpu/gpu-kernel-times {{builds}} {{out}}

# Per-layer time, bytes and peak memory on glm5-dims at 8/64/512 tokens for the full-model
# projection in BENCHMARKS.md: the CPU at 2 and all cores, and (on the GPU machine) the GPU.
projection out="target/projection" sides="cpu:2:f32,cpu:all:f32,cpu:all:bf16":
    scripts/gpu/gpu-env python3 benches/projection.py target/release/glmcheck {{out}} --sides {{sides}}

# On the GPU machine: GPU dequantization GB/s per type against the copy bandwidth (BENCHMARKS.md).
gpu-dequant-bench:
    scripts/gpu/gpu-dequant-bench target/release/glmcheck

# .venv-vllm: vLLM 0.23.0's CPU build (tests/vllm/vllm_gguf_load.rs, ~6 min once); `just setup-vllm 0.32`:
# .venv-vllm32, vLLM 0.32.0's with glmcheck's plugin (tests/vllm/vllm_today*.rs, ~2 min more).
setup-vllm release="0.23":
    scripts/setup-vllm {{release}}
