"""The products of one CPU decode step on llamactl's kernels, one after the other, each on its own
weight (so the weights stream from memory as in a step, not from a warm L2): the low-bit layers
(qgemv) and the 16-bit ones (bgemv: a bf16 model's layers, every model's 16-bit head) timed apart,
GB/s of the weights' bytes, best and median of SWEEPS sweeps. A kernel change is compared in
interleaved processes (docs/bench/cpu.md). Usage: python scripts/cpu_products.py FOLDER [SWEEPS]
"""

import json
import statistics
import sys
import time

import torch

from llamactl.layers.cpu import CpuLinear, CpuQuantLinear
from llamactl.layers.plan import prepare
from llamactl.runtime.load import load


def sweep(calls: list, sweeps: int) -> list[float]:
    """Seconds of each sweep over `calls` (op, args), after two to warm."""
    times = []
    with torch.inference_mode():
        for _ in range(sweeps + 2):
            t = time.perf_counter()
            for op, a in calls:
                op(*a)
            times.append(time.perf_counter() - t)
    return times[2:]


def main(folder: str, sweeps: int = 40) -> None:
    _, model, _, _ = load(folder, "cpu", "bfloat16")
    prepare(model)  # the step's layers: projections fused, the 16-bit ones on bgemv
    qgemv, bgemv = torch.ops.llamactl_cpu.qgemv.default, torch.ops.llamactl_cpu.bgemv.default
    x = lambda m: torch.randn(1, m.in_features, dtype=torch.bfloat16)  # noqa: E731
    kinds = {
        "qgemv": [(qgemv, (x(m), m.weight_packed, m.scales, m.zeros, m.blk2grp, m.perm, m.store_bits, m.out_features),
                   m.weight_packed.nbytes + m.scales.nbytes + m.zeros.nbytes)
                  for m in model.modules() if isinstance(m, CpuQuantLinear)],
        "bgemv": [(bgemv, (x(m), m.weight), m.weight.nbytes)
                  for m in model.modules() if isinstance(m, CpuLinear) and m.weight.dtype == torch.bfloat16],
    }
    out = {"folder": folder}
    for kind, calls in kinds.items():
        if not calls:
            continue
        times, nbytes = sweep([(op, a) for op, a, _ in calls], sweeps), sum(n for *_, n in calls)
        out[kind] = {"products": len(calls), "mb": round(nbytes / 1e6, 1), "best_ms": round(min(times) * 1e3, 3),
                     "median_ms": round(statistics.median(times) * 1e3, 3),
                     "best_gb_s": round(nbytes / min(times) / 1e9, 2),
                     "median_gb_s": round(nbytes / statistics.median(times) / 1e9, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
