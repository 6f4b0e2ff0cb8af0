"""Check a synthetic tokenizer folder against HF tokenizers, transformers and gguf-py.

argv[1] holds tokenizer.json, tokenizer_config.json, tokenizer.gguf and expect.json (ids and texts
from glmcheck's own encoder/decoder). Prints a JSON summary with "ok"; exits 1 listing every
mismatch.
"""

import json
import sys
from collections import Counter
from pathlib import Path

from gguf import GGUFReader, TokenType
from tokenizers import Tokenizer
from transformers import AutoTokenizer

# The folder checked and its expect.json, set by main().
folder: Path
want: dict
errors: list = []


def check(what, got, expected):
    if got != expected:
        errors.append(f"{what}: got {got!r}, want {expected!r}")


def check_hf():
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(folder))
    for case in want["cases"]:
        text, ids, decoded = case["text"], case["ids"], case["decoded"]
        check(f"tokenizers encode {text!r}", raw.encode(text).ids, ids)
        check(f"AutoTokenizer encode {text!r}", auto(text)["input_ids"], ids)
        check(f"tokenizers decode {text!r}", raw.decode(ids, skip_special_tokens=False), decoded)
        check(f"AutoTokenizer decode {text!r}", auto.decode(ids), decoded)
    for case in want["decode_cases"]:
        check(f"tokenizers decode {case['ids']}", raw.decode(case["ids"], skip_special_tokens=False), case["text"])
        check(f"AutoTokenizer decode {case['ids']}", auto.decode(case["ids"]), case["text"])
    check("eos_token_id", auto.eos_token_id, want["eos"])
    check("pad_token_id", auto.pad_token_id, want["eos"])
    return raw


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def check_gguf(raw):
    r = GGUFReader(folder / "tokenizer.gguf")
    g = lambda k: field(r, f"tokenizer.ggml.{k}")
    n, n_normal = want["vocab_size"], want["normal"]
    check("model", g("model"), "gpt2")
    check("pre", g("pre"), "gpt-2")
    tokens, types, merges = g("tokens"), g("token_type"), g("merges")
    check("token count", len(tokens), n)
    check("token_type count", len(types), n)
    check(
        "token types",
        dict(Counter(types)),
        {k: v for k, v in {
            int(TokenType.NORMAL): n_normal,
            int(TokenType.UNUSED): want["fillers"],
            int(TokenType.CONTROL): len(want["specials"]),
        }.items() if v},
    )
    check("specials at the end", tokens[n - len(want["specials"]):], want["specials"])
    hf_vocab = {t: i for i, t in enumerate(tokens) if types[i] != int(TokenType.UNUSED)}
    check("used tokens = tokenizer.json vocab", hf_vocab, raw.get_vocab(with_added_tokens=False))
    hf_merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    check("merges = tokenizer.json merges", merges, hf_merges)
    check("merge count", len(merges), want["merges"])
    check("eos", g("eos_token_id"), want["eos"])
    check("bos", g("bos_token_id"), want["bos"])
    check("padding", g("padding_token_id"), want["eos"])
    check("add_bos_token", g("add_bos_token"), False)


def main() -> None:
    global folder, want
    folder = Path(sys.argv[1])
    want = json.loads((folder / "expect.json").read_text())
    check_gguf(check_hf())
    print(json.dumps({"ok": not errors, "cases": len(want["cases"]), "vocab_size": want["vocab_size"]}))
    if errors:
        print("\n".join(errors), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
