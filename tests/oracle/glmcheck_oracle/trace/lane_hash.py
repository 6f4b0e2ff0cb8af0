"""The content hash three ways over deterministic bytes of awkward lengths: the probe's numpy
lanes (`glmcheck_probe.trace`), the word-by-word reference of `trace.check`, and, by
the Rust test that runs this script, glmcheck's own. Bytes i are (i * 31 + 7) mod 251.

Usage: python -m glmcheck_oracle.trace.lane_hash N [N ...]. Exits non-zero if the probe and the
reference differ; prints one JSON object {N: "16 hex digits"} for the Rust side to compare.
"""

import json
import sys

from glmcheck_oracle.trace import check as trace_check
from glmcheck_probe import trace as probe_trace


def main() -> None:
    hashes = {}
    for n in map(int, sys.argv[1:]):
        data = bytes((i * 31 + 7) % 251 for i in range(n))
        reference, probe = trace_check.content_hash(data), probe_trace.content_hash(data)
        if reference != probe:
            sys.exit(f"{n} bytes: the probe's hash {probe:016x}, the reference's {reference:016x}")
        hashes[n] = f"{reference:016x}"
    print(json.dumps(hashes))


if __name__ == "__main__":
    main()
