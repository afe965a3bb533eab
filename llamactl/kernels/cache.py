"""The Triton cache entries of llamactl's kernels, carried by `llamactl compile` artifacts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from llamactl.kernels.device import triton_version

# the @triton.jit functions of gemv.py, int4_layout.py and attention.py: their Triton cache entries travel with
# `llamactl compile` artifacts (compiled binaries and autotune choices)
KERNEL_NAMES = ("_gemv_kernel", "_gemv_int4_kernel", "_dequant_int4_kernel", "_split_kernel", "_merge_kernel")  # gemv, int4_layout, attention
LAUNCHERS = ("__triton_launcher", "cuda_utils")  # Triton's C launchers, in its cache too

def cache_dir() -> Path | None:
    """Triton's cache folder (TRITON_CACHE_DIR or its default), or None without Triton."""
    if triton_version() is None:
        return None
    from triton import knobs

    return Path(knobs.cache.dir)


def save_cache(dest: Path, arch: int) -> int:
    """Copy the Triton cache entries of llamactl's kernels built for CUDA compute capability `arch`
    (90 for sm_90), their autotune choices and Triton's compiled launchers to dest; returns how many
    entries. Kernels built for other GPUs (or by scripts/compile_kernels.py) stay behind. A launcher
    is a C extension named for its Python ABI, so another Python misses it and rebuilds it (about
    0.3 s each with gcc, which a warm start otherwise pays)."""
    src = cache_dir()
    if src is None or not src.is_dir():
        return 0
    n = 0
    for entry in sorted(src.iterdir()):
        files = [f for f in entry.iterdir() if f.name.startswith(KERNEL_NAMES + LAUNCHERS)] if entry.is_dir() else []
        if files and all(_built_for(f, arch) for f in files):
            shutil.copytree(entry, dest / entry.name, dirs_exist_ok=True)
            n += 1
    return n


def _built_for(f: Path, arch: int) -> bool:
    """False for a kernel's metadata file (NAME.json) that names another target than CUDA `arch`."""
    if f.suffix != ".json" or f.name.endswith(".autotune.json"):
        return True
    try:
        target = json.loads(f.read_text()).get("target", {})
    except (OSError, ValueError):
        return False
    return target.get("backend") == "cuda" and target.get("arch") == arch


def load_cache(src: Path, skip: frozenset[str] = frozenset()) -> int:
    """Add saved entries to Triton's cache (existing ones, and those named in skip, are kept out);
    returns how many were added."""
    dest = cache_dir()
    if dest is None or not src.is_dir():
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for entry in sorted(src.iterdir()):
        target = dest / entry.name
        if entry.is_dir() and not target.exists() and entry.name not in skip:
            tmp = dest / f".{entry.name}.llamactl-tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(entry, tmp)
            try:
                tmp.rename(target)  # atomic: a concurrent reader never sees half an entry
                n += 1
            except OSError:  # another process put it there first
                shutil.rmtree(tmp, ignore_errors=True)
    return n
