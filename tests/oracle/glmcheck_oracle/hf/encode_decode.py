"""transformers' tokenizer of a folder: `python -m glmcheck_oracle.hf.encode_decode FOLDER TEXT
IDS` → JSON {ids, text}, the ids of TEXT (no special tokens) and the decoding of the
comma-separated IDS."""

import json
import sys

from transformers import AutoTokenizer


def main() -> None:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    ids = [int(i) for i in sys.argv[3].split(",")]
    print(json.dumps({"ids": tok.encode(sys.argv[2], add_special_tokens=False), "text": tok.decode(ids)}))


if __name__ == "__main__":
    main()
