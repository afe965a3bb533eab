"""The CPU cores this process may use, and torch's threads set to them.

PyTorch starts as many intra-op threads as the machine has cores, not as many as the process may
run on: in a container limited to 2 CPUs of a 64-core host, 64 threads share 2 cores' time and a
decode step slows down many times. The usable count is the process's CPU affinity, capped by a
cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`); OMP_NUM_THREADS, where the user set it,
is their word and left alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def quota(root: Path = CGROUP) -> float | None:
    """CPUs the cgroup quota allows (e.g. 2.0), or None without a quota."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            limit, period = v2.read_text().split()[:2]
            return None if limit == "max" else int(limit) / int(period)
        limit = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if limit <= 0 else limit / period
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        return None


def usable(root: Path = CGROUP) -> int:
    """The cores this process may use: its affinity, capped by the cgroup quota (rounded up)."""
    cores = len(os.sched_getaffinity(0))
    q = quota(root)
    return max(1, min(cores, math.ceil(q))) if q else cores


def limit_threads_env() -> None:
    """Before torch is imported (the CLI's start): OMP_NUM_THREADS = usable() unless the user set
    it, which torch reads for its intra-op threads when a command first imports it; `llamactl
    --help` and the commands that need no torch never import it."""
    os.environ.setdefault("OMP_NUM_THREADS", str(usable()))


def set_torch_threads() -> int:
    """torch's intra-op threads = usable(), unless OMP_NUM_THREADS is set; returns the count."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        cores = usable()
        if torch.get_num_threads() != cores:
            torch.set_num_threads(cores)
    return torch.get_num_threads()
