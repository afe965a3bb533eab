"""llamactl's own Triton kernels for the batch-1 decode step.

gemv       bf16 and 4-bit matrix-vector products that read weights near memory bandwidth
attention  split-KV decode attention that reads the cache only up to the current position

They run on CUDA when Triton is importable; with TRITON_INTERPRET=1 they run on the CPU through
Triton's interpreter (slow; used by the tests). `available` says whether they can run on a device.
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

# the @triton.jit functions of gemv.py and attention.py: their Triton cache entries travel with
# `llamactl compile` artifacts (compiled binaries and autotune choices)
KERNEL_NAMES = ("_gemv_kernel", "_gemv_int4_kernel", "_dequant_int4_kernel", "_split_kernel", "_merge_kernel")


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


def cache_dir() -> Path | None:
    """Triton's cache folder (TRITON_CACHE_DIR or its default), or None without Triton."""
    if triton_version() is None:
        return None
    from triton import knobs

    return Path(knobs.cache.dir)


def save_cache(dest: Path) -> int:
    """Copy the Triton cache entries of llamactl's kernels to dest; returns how many entries."""
    src = cache_dir()
    if src is None or not src.is_dir():
        return 0
    n = 0
    for entry in sorted(src.iterdir()):
        if entry.is_dir() and any(f.name.startswith(KERNEL_NAMES) for f in entry.iterdir()):
            shutil.copytree(entry, dest / entry.name, dirs_exist_ok=True)
            n += 1
    return n


def load_cache(src: Path) -> int:
    """Add saved entries to Triton's cache (existing ones are kept); returns how many were added."""
    dest = cache_dir()
    if dest is None or not src.is_dir():
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for entry in sorted(src.iterdir()):
        target = dest / entry.name
        if entry.is_dir() and not target.exists():
            tmp = dest / f".{entry.name}.llamactl-tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(entry, tmp)
            try:
                tmp.rename(target)  # atomic: a concurrent reader never sees half an entry
                n += 1
            except OSError:  # another process put it there first
                shutil.rmtree(tmp, ignore_errors=True)
    return n
