"""llamactl's CPU kernels (cpu_gemv.cpp, cpu_attention.cpp): built once per machine with the
system's C++ compiler into one library and loaded as torch operators
(torch.ops.llamactl_cpu.qgemv / bgemv / dequant / decode_attention).

The library is compiled for this CPU (-march=native) into the user's cache
(~/.cache/llamactl/cpu-kernels, or XDG_CACHE_HOME), named by a hash of the sources, the torch
version, the compiler and the CPU's flags, so another machine, torch or source builds its own.
The build writes to a temporary name and renames it into place (atomic; a second process waiting
for the first finds it built). Nothing is built from a model folder. Where no compiler is found,
or the build fails, `load()` returns the reason and the layers keep torch's paths.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_gemv.cpp", "cpu_attention.cpp")]
MAX_ROWS = 8  # rows one bgemv call multiplies (cpu_gemv.cpp MAX_ROWS); more go to torch's matmul
VNNI, BF16 = 1, 2  # features() bits: the vector paths the build has
ATTN_MAX_GROUP, ATTN_MAX_HEAD_DIM = 16, 256  # what decode_attention takes (cpu_attention.cpp MAX_R, MAX_D)


def cache_root(part: str = "cpu-kernels") -> Path:
    """llamactl's folder `part` in the user's cache (XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamactl" / part


def cpu_flags() -> str:
    """The CPU's flags line (/proc/cpuinfo), what builds for this CPU depend on."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _command(cxx: str, out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    lib = library_paths()[0]
    return [cxx, "-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-DNDEBUG",
            "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
            *[f"-I{p}" for p in include_paths()], *map(str, SOURCES), f"-L{lib}", f"-Wl,-rpath,{lib}",
            "-lc10", "-ltorch_cpu", "-o", str(out)]


def compiler_stamp(exe: str) -> str:
    """A compiler named by its file: path, size and time (no process started per load)."""
    real = Path(shutil.which(exe) or exe).resolve()
    st = real.stat()
    return f"{real}:{st.st_size}:{st.st_mtime_ns}"


def build_once(path: Path, command: Callable[[Path], list[str]], timeout: int = 600) -> str | None:
    """Build `path` unless it is there: command(out) writes it to `out`, a temporary name beside it
    renamed into place (a second process waiting for the first finds it built); None, or the
    build's first error line."""
    if path.is_file():
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    out = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        done = subprocess.run(command(out), capture_output=True, text=True, timeout=timeout)
        if done.returncode:
            return next((ln for ln in done.stderr.splitlines() if "error" in ln), done.stderr.strip()[-200:])
        os.replace(out, path)
    finally:
        out.unlink(missing_ok=True)
    return None


def _library_path(cxx: str) -> Path:
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in SOURCES), torch.__version__.encode(), compiler_stamp(cxx).encode(),
                 cpu_flags().encode(), sys.version.encode()):
        h.update(part)
    return cache_root() / f"llamactl_cpu-{h.hexdigest()[:16]}.so"


@functools.lru_cache(maxsize=None)
def load() -> str | None:
    """Build (first use on this machine) and load the CPU kernels; None when they are loaded, else
    why not (one line, for the plan's warning)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"llamactl's CPU kernels are built for x86-64 Linux, not {sys.platform} {platform.machine()}"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler (g++) found to build llamactl's CPU kernels; install one, or set CXX"
    try:
        path = _library_path(cxx)
        failed = build_once(path, lambda out: _command(cxx, out))
        if failed:
            return f"building llamactl's CPU kernels failed ({cxx}): {failed}"
        torch.ops.load_library(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        return f"llamactl's CPU kernels could not be built or loaded: {e}"
    return None


def loaded() -> bool:
    """Whether the CPU kernels are loaded in this process (load() ran and succeeded; this builds nothing)."""
    return load.cache_info().currsize > 0 and load() is None


def has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (oneDNN's bf16 matmul then runs on them)."""
    return "amx_bf16" in cpu_flags().split()


def features() -> int:
    """The vector paths of the loaded build (VNNI | BF16); 0 when only plain loops run."""
    return int(torch.ops.llamactl_cpu.features())
