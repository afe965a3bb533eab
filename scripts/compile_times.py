"""Run one llamactl command in this process, then print where torch.compile spent its time.

torch._dynamo's own per-phase timers (tracing, AOT autograd, Inductor lowering and code generation,
loading cached modules, guard building), summed over every compiled graph, largest first, plus
the whole command's wall time. Used by compile_warm_start.sh to split a warm start's compile work.
Usage: python scripts/compile_times.py [--min SECONDS] -- LLAMACTL ARGS...
"""

from __future__ import annotations

import sys
import time


def main() -> None:
    args = sys.argv[1:]
    floor = 0.1
    if args[:1] == ["--min"]:
        floor, args = float(args[1]), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    t0 = time.perf_counter()
    sys.argv = ["llamactl", *args]
    from llamactl.cli import main as llamactl

    try:
        llamactl()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    wall = time.perf_counter() - t0
    import torch._dynamo.utils as dynamo_utils

    names, values = dynamo_utils.compile_times(repr="csv", aggregate=True)  # one summed figure a phase
    rows = sorted(zip(names, map(float, values)), key=lambda r: -r[1])
    print(f"whole command {wall:.2f} s; torch.compile phases >= {floor} s (nested phases overlap):", file=sys.stderr)
    for name, secs in rows:
        if secs >= floor:
            print(f"  {secs:8.2f} s  {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
