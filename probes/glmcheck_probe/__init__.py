"""glmcheck probes: hook an inference engine and write glmcheck traces (docs/design.md §5).

`trace` is the engine-independent writer; `transformers_probe` hooks a Hugging Face
`GlmMoeDsaForCausalLM`.
"""
