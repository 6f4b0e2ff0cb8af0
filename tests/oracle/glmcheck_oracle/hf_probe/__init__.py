"""The transformers probe (`glmcheck_probe.transformers_probe`) run on models with a bug planted
in the process, and at tensor parallelism: ranks sharded by hand over gloo on CPU (`tp_ranks`),
or transformers' own TP plan under torchrun on GPUs with a bug in one rank's shard
(`tp_planted`)."""
