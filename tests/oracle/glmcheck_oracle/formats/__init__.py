"""GGUF and safetensors files made, read, quantized and broken with gguf-py, numpy and
safetensors: the oracles of glmcheck's readers, writers, quantizers and shard checks."""
