"""The transformers probe (`glmcheck_probe.transformers_probe`) run on models with a bug planted
in the process, and at tensor parallelism on CPU."""
