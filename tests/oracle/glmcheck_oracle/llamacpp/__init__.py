"""Tiny GLM-5s made by transformers and converted, quantized and split by llama.cpp's own tools
(the tree and build scripts/setup-llamacpp makes in .oracles/llama.cpp)."""
