"""Print a GGUF's architecture and (name, row-major shape) of every tensor, as gguf-py reads them."""

import json
import sys

from gguf import GGUFReader

r = GGUFReader(sys.argv[1])
arch = r.fields["general.architecture"].contents()
print(json.dumps({"arch": arch, "tensors": [[t.name, [int(d) for d in reversed(t.shape)]] for t in r.tensors]}))
