"""Overwrite one tensor of a Hugging Face folder's safetensors with another tensor's values, in
place (the bug of a converter that writes one expert's rows under another's name).

Usage: python -m glmcheck_oracle.hf.copy_tensor FOLDER TENSOR FROM_TENSOR

Both tensors must have the same shape and dtype and be in one file of FOLDER. Prints the file
it rewrote.
"""

import sys
from pathlib import Path

from safetensors.torch import load_file, save_file


def main() -> None:
    folder, name, source = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    for f in sorted(folder.glob("*.safetensors")):
        tensors = load_file(f)
        if name in tensors and source in tensors:
            if tensors[name].shape != tensors[source].shape:
                raise SystemExit(f"{name} and {source} differ in shape")
            tensors[name] = tensors[source].clone()
            save_file(tensors, f, metadata={"format": "pt"})
            print(f)
            return
    raise SystemExit(f"{folder}: no file holds both {name} and {source}")


if __name__ == "__main__":
    main()
