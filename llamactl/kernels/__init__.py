"""llamactl's own Triton kernels for the batch-1 decode step.

gemv       bf16 and 4-bit matrix-vector products that read weights near memory bandwidth
attention  split-KV decode attention that reads the cache only up to the current position

They run on CUDA when Triton is importable; with TRITON_INTERPRET=1 they run on the CPU through
Triton's interpreter (slow; used by the tests). `available` says whether they can run on a device.
"""

from __future__ import annotations

import functools
import os

import torch


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def available(device: torch.device) -> bool:
    """Whether llamactl's Triton kernels run on `device` (LLAMACTL_KERNELS=0 turns them off)."""
    if os.environ.get("LLAMACTL_KERNELS", "1") == "0" or triton_version() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())
