"""Print a GGUF's architecture, its `general.file_type` by gguf-py's `LlamaFileType` name (null
when absent), (name, row-major shape) of every tensor as gguf-py reads them, and the tensors whose
names are not among gguf-py's tensor names for that architecture."""

import json
import sys

from gguf import GGUFReader, LlamaFileType
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES


def main() -> None:
    r = GGUFReader(sys.argv[1])
    arch = r.fields["general.architecture"].contents()
    blocks = int(r.fields[f"{arch}.block_count"].contents())
    model_arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)
    known = {TENSOR_NAMES[t].format(bid=b) for t in MODEL_TENSORS[model_arch] for b in range(blocks)}
    unknown = [t.name for t in r.tensors if t.name.rsplit(".", 1)[0] not in known]
    file_type = r.fields.get("general.file_type")
    print(json.dumps({
        "arch": arch,
        "file_type": LlamaFileType(int(file_type.contents())).name if file_type else None,
        "tensors": [[t.name, [int(d) for d in reversed(t.shape)]] for t in r.tensors],
        "unknown": unknown,
    }))


if __name__ == "__main__":
    main()
