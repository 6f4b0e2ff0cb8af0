"""The probe's moments (`glmcheck_probe.trace.moments`, numpy) over deterministic f32 values of
awkward lengths, for the Rust test that runs this script to compare with `TensorStats::of` bit
for bit. Value i is ((i * 7919) mod 2001 - 1000) / 37 in float32, with NaN at every 1000th
index, +Inf at every 1777th, -Inf at every 2500th, +0 at every 300th and -0 at every 301st
(each from index 1 on).

Usage: python -m glmcheck_oracle.trace.moments N [N ...]. Prints one JSON object
{N: {stat: value}}, floats as 17-digit strings so that no reader rounds them.
"""

import json
import sys

import numpy as np
from glmcheck_probe import trace as probe_trace


def values(n: int) -> np.ndarray:
    i = np.arange(n, dtype=np.int64)
    x = (((i * 7919) % 2001) - 1000).astype(np.float32) / np.float32(37)
    for every, v in ((1000, np.nan), (1777, np.inf), (2500, -np.inf), (300, 0.0), (301, -0.0)):
        x[every::every] = v
    return x


def main() -> None:
    out = {}
    for n in map(int, sys.argv[1:]):
        stats = probe_trace.moments(values(n))
        out[n] = {k: (repr(float(v)) if isinstance(v, float) else v) for k, v in stats.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
