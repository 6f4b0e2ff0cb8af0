"""SGLang 0.5.23 debug-dump folders made by SGLang's own dumper (`dumper.py` from the pinned
wheel, unmodified) around a plain-torch GLM-5 built and called as SGLang builds and calls it,
at TP 1/2/4 over gloo on CPU, with bugs to plant: the fixture for `glmcheck bisect MODEL
--candidate DUMP_DIR`.

* `standins`: the `sglang.*` modules the dumper imports, and loading the dumper;
* `layers`, `moe`, `model`: the model, module by module as SGLang names and calls them;
* `weights`: a Hugging Face GLM-5 folder cut into one rank's shards;
* `dump`: the command (one prefill, optionally decode steps, dumped), and `--check` against
  transformers.
"""
