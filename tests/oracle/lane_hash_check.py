"""The content hash three ways over deterministic bytes of awkward lengths: the probe's numpy
lanes (`glmcheck_probe.trace`), this folder's word-by-word reference (`trace_check.py`), and, by
the Rust test that runs this script, glmcheck's own. Bytes i are (i * 31 + 7) mod 251.

Usage: lane_hash_check.py N [N ...]. Exits non-zero if the probe and the reference differ;
prints one JSON object {N: "16 hex digits"} for the Rust side to compare.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "probes"))

import trace_check  # noqa: E402
from glmcheck_probe import trace as probe_trace  # noqa: E402

hashes = {}
for n in map(int, sys.argv[1:]):
    data = bytes((i * 31 + 7) % 251 for i in range(n))
    reference, probe = trace_check.content_hash(data), probe_trace.content_hash(data)
    if reference != probe:
        sys.exit(f"{n} bytes: the probe's hash {probe:016x}, the reference's {reference:016x}")
    hashes[n] = f"{reference:016x}"
print(json.dumps(hashes))
