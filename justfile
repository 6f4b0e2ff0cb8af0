# Tasks of the glmcheck crate; `just --list` shows them.

# Every test, the Python oracles set up first (arguments go to `cargo test`).
test *ARGS:
    scripts/test {{ARGS}}

# Dequantization throughput of glmcheck, candle and gguf-py; also writes bench-results/dequant.md.
bench:
    scripts/setup-venv
    cargo bench --bench dequant

# The demo: a tiny synthetic GLM-5 GGUF, inspected and dequantized.
demo:
    cargo run --release -- demo

# Fuzz a target (gguf_header, safetensors_header) for SECONDS; needs nightly and cargo-fuzz (fuzz/README.md).
fuzz target="gguf_header" seconds="300":
    scripts/setup-venv
    .venv/bin/python fuzz/make_seeds.py
    cd fuzz && cargo +nightly fuzz run {{target}} -- -max_total_time={{seconds}}
