"""The int4 GEMV's three arithmetics against their exact references, per candidate config, at test
and at llama2-7b sizes (GPU): float inputs (float32 in and out: error ~1e-7), int8 inputs (against
x rounded per 32 columns as the kernel rounds it: ~1e-7 when the rounding matches), packed fp16
(against float inputs: ~5e-4). Prints one line per (size, config) with the three errors.
Usage: python scripts/int4_exactness.py [OUT.json]
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_kernels import _int4_case, _int8_per_32, rel  # noqa: E402

from llamactl.kernels import gemv  # noqa: E402


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    fixed = gemv.FIXED_BLOCKS, gemv.INT4_FIXED
    gemv.FIXED_BLOCKS = True
    try:
        for n, k in [(72, 1152), (24, 640), (4096, 4096), (4096, 11008)]:
            q, s, z, w = _int4_case(n, k, 128, seed=7)
            q, s, z, w = q.to(dev), s.to(dev), z.to(dev), w.to(dev)
            x = torch.randn(k, device=dev, dtype=torch.bfloat16).float()
            exact, rounded = w @ x.double(), w @ _int8_per_32(x).to(dev)
            for c in gemv._int4_configs():
                gemv.INT4_FIXED = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                row = {"n": n, "k": k, "config": gemv.INT4_FIXED,
                       "float": rel(gemv.gemv_int4(x, q, s, z, 128), exact),
                       "int8": rel(gemv.gemv_int4(x, q, s, z, 128, inputs="int8"), rounded),
                       "fp16": rel(gemv.gemv_int4(x, q, s, z, 128, inputs="fp16"), exact)}
                rows.append(row)
                print(f"{n}x{k} {c}: float {row['float']:.1e} int8 {row['int8']:.1e} fp16 {row['fp16']:.1e}",
                      flush=True)
    finally:
        gemv.FIXED_BLOCKS, gemv.INT4_FIXED = fixed
    if len(sys.argv) > 1:
        json.dump(rows, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
