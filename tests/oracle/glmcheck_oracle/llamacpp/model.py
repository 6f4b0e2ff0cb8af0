"""A tiny random GLM-5 made with transformers, converted to an F32 GGUF by llama.cpp's converter.

Usage: python -m glmcheck_oracle.llamacpp.model OUT_DIR --llama-cpp SRC [--rms-norm-eps E] [--seed S]
                                                 [--tokens IDS]... [--generate N]

SRC is the llama.cpp source tree that scripts/setup-llamacpp unpacks (.oracles/llama.cpp/src): its
`convert_hf_to_gguf.py` (with its own gguf-py) does the conversion. Writes into OUT_DIR:

* `hf/`: the `GlmMoeDsaForCausalLM` checkpoint (`save_pretrained`, float32 safetensors) with a toy
  byte-level BPE tokenizer carrying the special tokens the converter's GLM vocabulary looks up;
* `model-f32.gguf`: the converter's `--outtype f32` output (arch `glm-dsa`);
* `hf-logits-K.f32`: transformers' float32 logits of the K-th `--tokens` sequence, computed by the
  reloaded checkpoint, raw little-endian float32 [T][V].

Prints JSON: {"hf", "gguf", "vocab_size", "sequences": [{"tokens", "logits", "generated"}]}, with
`generated` the `--generate N` greedy tokens of transformers after that sequence.

The config keeps clear of what llama.cpp cannot run or breaks ties on: 16 indexer heads (so
DSA scores have no exact ties), index_head_dim 64 (llama.cpp's indexer Hadamard rotation needs a
power of two >= 64), index_topk 4 (sequences longer than 4 really select), kv_lora_rank + rope
(24) != index_head_dim, no MTP layer. Weights are re-drawn from the seed at scales that give
logits of std about 3, with a router correction bias large enough to change expert choices.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

# The converter's own GLM vocabulary (`_set_vocab_glm`) looks these up by name.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
]
# "Ġ" is the byte-level symbol of a space.
MERGES = [("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġt", "he"), ("e", "r"), ("a", "n"), ("o", "n"), ("Ġ", "a")]
EOS_ID = 256 + len(MERGES)  # <|endoftext|>
GMASK_ID = EOS_ID + 2  # [gMASK]


def config(rms_norm_eps: float, **sizes):
    """The oracle's GLM-5 config; `sizes` replaces any of its keyword values (another script of
    tests/oracle makes a wider model with the same constraints)."""
    from transformers import GlmMoeDsaConfig

    values = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_n_heads=16,
        index_head_dim=64,
        index_topk=4,
        max_position_embeddings=256,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=False,
        bos_token_id=GMASK_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
    )
    values.update(sizes)
    return GlmMoeDsaConfig(**values)


def reinit(model, seed: int) -> None:
    """Draw every weight from `seed`: matrices N(0, 1/fan_in), embeddings N(0, 1), norm weights
    1 + 0.2 N, the indexer LayerNorm bias 0.1 N, the router correction bias 0.3 N, lm_head ×3."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            n = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("embed_tokens.weight"):
                p.copy_(n)
            elif name == "lm_head.weight":
                p.copy_(3.0 * n / p.shape[-1] ** 0.5)
            elif name.endswith(".bias"):
                p.copy_(0.1 * n)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.2 * n)
            else:
                p.copy_(n / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g, dtype=torch.float32))


def tokenizer():
    """A byte-level BPE: the 256 byte symbols, a few merges (llama.cpp requires merges in a `gpt2`
    vocabulary), then the GLM special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    assert fast.convert_tokens_to_ids("<|endoftext|>") == EOS_ID
    assert fast.convert_tokens_to_ids("[gMASK]") == GMASK_ID
    return fast


def keep_add_bos_token(hf: Path) -> None:
    """Load `hf`'s tokenizer with its `tokenizer_config.json` `add_bos_token`, as the converter's
    pinned transformers (4.57) does: transformers 5 drops the key wherever a `tokenizer.json`
    exists, and the converter's DeepSeek-V3.2 vocabulary asserts it."""
    import transformers

    config = json.loads((hf / "tokenizer_config.json").read_text())
    if "add_bos_token" not in config:
        return
    load = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(path, *args, **kwargs):
        kwargs.setdefault("add_bos_token", config["add_bos_token"])
        return load(path, *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = from_pretrained


def convert(llama_cpp: Path, hf: Path, gguf: Path, outtype: str = "f32", pre: str = "glm4") -> None:
    """Run the vendored convert_hf_to_gguf.py (`--outtype OUTTYPE`) in this process. Its pre-tokenizer check hashes the
    tokens of a fixed text and knows only real tokenizers; for the toy one it raises
    NotImplementedError, and only then this says `pre` (`glm4`: what GLM-5's own tokenizer maps
    to; another member passes its own). The ids are fed directly, so the pre-tokenizer never
    runs. Nothing in the converter is edited."""
    sys.path.insert(0, str(llama_cpp))
    import convert_hf_to_gguf
    from conversion import TextModel

    known = TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tok):
        try:
            return known(self, tok)
        except NotImplementedError:
            return pre

    TextModel.get_vocab_base_pre = vocab_base_pre
    keep_add_bos_token(hf)
    sys.argv = ["convert_hf_to_gguf.py", str(hf), "--outtype", outtype, "--outfile", str(gguf)]
    convert_hf_to_gguf.main()
    if not gguf.exists():
        raise SystemExit(f"the converter wrote no {gguf}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--rms-norm-eps", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", action="append", default=[])
    ap.add_argument("--generate", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, GlmMoeDsaForCausalLM

    torch.manual_seed(args.seed)
    hf = args.out / "hf"
    model = GlmMoeDsaForCausalLM(config(args.rms_norm_eps)).float().eval()
    reinit(model, args.seed)
    model.save_pretrained(hf, safe_serialization=True)
    tokenizer().save_pretrained(hf)

    # The reference is the reloaded checkpoint: what glmcheck and the converter read.
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    sequences = []
    for k, ids in enumerate(args.tokens):
        tokens = [int(t) for t in ids.split(",")]
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0].float()
            generated = []
            if args.generate > 0:
                out = model.generate(
                    torch.tensor([tokens]),
                    max_new_tokens=args.generate,
                    min_new_tokens=args.generate,
                    do_sample=False,
                )
                generated = out[0, len(tokens) :].tolist()
        path = args.out / f"hf-logits-{k}.f32"
        logits.contiguous().numpy().astype("<f4").tofile(path)
        sequences.append({"tokens": tokens, "logits": str(path), "generated": generated})

    gguf = args.out / "model-f32.gguf"
    convert(args.llama_cpp, hf, gguf)
    print(
        json.dumps(
            {
                "hf": str(hf),
                "gguf": str(gguf),
                "vocab_size": model.config.vocab_size,
                "sequences": sequences,
            }
        )
    )


if __name__ == "__main__":
    main()
