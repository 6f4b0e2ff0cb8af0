"""Dequantize two GGUFs with gguf-py and report the worst relative RMS difference per tensor.

Usage: python -m glmcheck_oracle.formats.compare_gguf REFERENCE.gguf CANDIDATE.gguf — both must
hold the same tensor names and shapes. Prints JSON {"arch", "worst_tensor", "worst_rel_rms",
"tensors"}.
"""

import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def tensors(path):
    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    return arch, {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}


def main() -> None:
    _, ref = tensors(sys.argv[1])
    arch, cand = tensors(sys.argv[2])
    assert ref.keys() == cand.keys(), "tensor names differ"
    worst = ("", 0.0)
    for name, a in ref.items():
        b = cand[name]
        assert a.shape == b.shape, f"{name}: {a.shape} vs {b.shape}"
        rel = float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(a**2)), 1e-30))
        if rel > worst[1]:
            worst = (name, rel)
    print(json.dumps({"arch": arch, "worst_tensor": worst[0], "worst_rel_rms": worst[1], "tensors": len(ref)}))


if __name__ == "__main__":
    main()
