"""SGLang 0.5.23 debug-dump folders made by SGLang's own dumper (`dumper.py` from the pinned
wheel, unmodified) around a plain-torch model of the family (GLM-5, DeepSeek-V2/V2-Lite/V3/V3.2,
Kimi-K2, GLM-4.7-Flash) built and called as SGLang builds and calls it,
at TP 1/2/4 over gloo on CPU, with bugs to plant: the fixture for `glmcheck bisect MODEL
--candidate DUMP_DIR`.

* `standins`: the `sglang.*` modules the dumper imports, and loading the dumper;
* `layers`, `moe`, `model`: the model, module by module as SGLang names and calls them;
* `weights`: a Hugging Face folder of the family read as SGLang's config and cut into one
  rank's shards;
* `dump`: the command (one prefill, optionally decode steps, dumped), and `--check` against
  transformers.
"""
