"""A tiny GLM-5 wide enough for K-quants, quantized by llama.cpp's own tools.

Usage: python -m glmcheck_oracle.llamacpp.quants OUT_DIR --llama-cpp ORACLE [--seed S]
                                                  [--set KEY=INT]...

ORACLE is the folder scripts/setup-llamacpp builds (.oracles/llama.cpp): `src/convert_hf_to_gguf.py`
converts, llama.cpp's `llama-quantize` and `llama-imatrix` from its build/tools/ quantize
(`$LLAMA_QUANTIZE` and `$LLAMA_IMATRIX` name other binaries). Writes into OUT_DIR:

* `hf/`: a `GlmMoeDsaForCausalLM` saved by transformers (float32 safetensors) with the toy
  tokenizer of `llamacpp.model`;
* `f32.gguf`: llama.cpp's converter's `--outtype f32` output;
* `q8_0.gguf`, `q6_k.gguf`, `q4_k_m.gguf`, `iq4_xs.gguf`: `llama-quantize f32.gguf OUT TYPE`;
* `calibration.txt` (plain English), `imatrix.gguf` (`llama-imatrix -c 64` over it, CPU, 2 threads)
  and `q4_k_m-imatrix.gguf` (`llama-quantize --imatrix imatrix.gguf ... Q4_K_M`).

Prints one line of JSON: {"files": {name: path}, "types": {file: {tensor: GGML type name}}} with
the types read back by gguf-py's reader.

Widths: every matrix llama.cpp quantizes has rows of 256 or 512 values (hidden 256, q_lora_rank
and kv_lora_rank 256, 4 heads of v_head_dim 64, intermediate 512, moe_intermediate 256), so
K-quants and IQ4_XS apply as they do on the real model; attn_k_b's rows are qk_nope_head_dim (64)
long, as in GLM-5 not a multiple of 256, and llama-quantize falls back for it (Q4_K to Q5_0,
Q6_K to Q8_0, IQ4_XS to IQ4_NL). The oracle constraints of `llamacpp.model` hold: 16 indexer
heads, index_head_dim 64, index_topk 4, kv_lora_rank + rope (272) != index_head_dim, no MTP
layer; weights are drawn by its `reinit` (nonzero router correction bias).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SIZES = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=256,
    kv_lora_rank=256,
    qk_rope_head_dim=16,
    qk_nope_head_dim=64,
    v_head_dim=64,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=4,
)

# llama-quantize's type names, by output file stem.
QUANTS = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q4_k_m": "Q4_K_M", "iq4_xs": "IQ4_XS"}

CALIBRATION = """\
The river runs past the old mill and under the stone bridge before it reaches the town. In the
morning the baker opens his shop, and the smell of warm bread fills the narrow street. Children
walk to school with their bags on their backs, and a dog follows them as far as the corner. At
noon the market is busy: farmers sell apples, cheese and eggs, and the people who buy them talk
about the weather and the price of wood. When the sun goes down, the lamps are lit one by one,
the shops close their doors, and the town grows quiet until the first cart comes in at dawn.
"""

THREADS = "2"


def tool(oracle: Path, name: str, env: str) -> Path:
    """A llama.cpp program: `$ENV`, else where the oracle's build puts it (build/tools/*/).
    Absolute, since the tools run in OUT_DIR."""
    if os.environ.get(env):
        return Path(os.environ[env]).resolve()
    path = oracle / "build" / "tools" / name.removeprefix("llama-") / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise SystemExit(f"no {path}: run scripts/setup-llamacpp")
    return path.resolve()


def run(args: list, cwd: Path) -> None:
    """One llama.cpp tool in `cwd` (file names relative to it, so that the paths the tools record
    in the files they write do not depend on OUT_DIR). Passive OpenMP waits keep two threads from
    spinning against each other on a busy machine; the results do not depend on it."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, env=env)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"{Path(str(args[0])).name} failed with exit code {done.returncode}")


def types_of(path: Path) -> dict:
    """Every tensor's type, over all files of a split set (NAME-00001-of-0000N.gguf)."""
    from gguf import GGUFReader

    paths = [path]
    if "-00001-of-" in path.name:
        paths = sorted(path.parent.glob(path.name.replace("-00001-of-", "-*-of-")))
    return {t.name: t.tensor_type.name for p in paths for t in GGUFReader(p).tensors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="replace one of SIZES (vLLM's MLA takes kv_lora_rank 512 and "
                         "qk_rope_head_dim 64 only)")
    args = ap.parse_args()
    sizes = dict(SIZES)
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in sizes:
            raise SystemExit(f"--set {item}: not one of {', '.join(sizes)}")
        sizes[key] = int(value)
    out, oracle = args.out.resolve(), args.llama_cpp.resolve()
    quantize = tool(oracle, "llama-quantize", "LLAMA_QUANTIZE")
    imatrix = tool(oracle, "llama-imatrix", "LLAMA_IMATRIX")
    gguf_split = tool(oracle, "llama-gguf-split", "LLAMA_GGUF_SPLIT")
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import GlmMoeDsaForCausalLM

    from glmcheck_oracle.llamacpp import model as base

    torch.manual_seed(args.seed)
    hf = out / "hf"
    model = GlmMoeDsaForCausalLM(base.config(1e-6, **sizes)).float().eval()
    base.reinit(model, args.seed)
    model.save_pretrained(hf, safe_serialization=True)
    base.tokenizer().save_pretrained(hf)
    del model

    files = {"hf": hf, "f32": out / "f32.gguf"}
    base.convert(oracle / "src", hf, files["f32"])

    for stem, qtype in QUANTS.items():
        files[stem] = out / f"{stem}.gguf"
        run([quantize, "f32.gguf", f"{stem}.gguf", qtype, THREADS], out)

    # The Q4_K_M as a split set, as large GGUFs are published: llama.cpp's own splitter.
    run([gguf_split, "--split", "--split-max-tensors", "24", "q4_k_m.gguf", "q4_k_m-split"], out)
    files["q4_k_m-split"] = sorted(out.glob("q4_k_m-split-00001-of-*.gguf"))[0]

    files["calibration"] = out / "calibration.txt"
    files["calibration"].write_text(CALIBRATION)
    files["imatrix"] = out / "imatrix.gguf"
    run(
        [imatrix, "-m", "f32.gguf", "-f", "calibration.txt", "-o", "imatrix.gguf",
         "-c", "64", "-b", "64", "-t", THREADS, "-ngl", "0", "--no-ppl"],
        out,
    )
    files["q4_k_m-imatrix"] = out / "q4_k_m-imatrix.gguf"
    run([quantize, "--imatrix", "imatrix.gguf", "f32.gguf", "q4_k_m-imatrix.gguf", "Q4_K_M", THREADS], out)

    types = {k: types_of(p) for k, p in files.items()
             if k == "f32" or k in QUANTS or k in ("q4_k_m-imatrix", "q4_k_m-split")}
    print(json.dumps({"files": {k: str(p) for k, p in files.items()}, "types": types}))


if __name__ == "__main__":
    main()
