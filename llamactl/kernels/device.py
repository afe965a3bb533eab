"""Where llamactl's kernels run: Triton's presence, the CPU interpreter, the GPU's generation."""

from __future__ import annotations

import functools
import os

import torch


def interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1, Triton's own switch)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can launch on `device`: CUDA with Triton, or the CPU under the
    interpreter. (On CUDA, check.passed says whether they also compute right there.)"""
    if triton_version() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def index(device: torch.device) -> int:
    """The CUDA device's index (the current device's for a bare "cuda")."""
    return torch.cuda.current_device() if device.index is None else device.index


@functools.lru_cache(maxsize=None)
def capability(idx: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(idx)


@functools.lru_cache(maxsize=None)
def name(idx: int) -> str:
    return torch.cuda.get_device_name(idx)


def pdl_supported(device: torch.device) -> bool:
    """Whether the kernels can launch with programmatic dependent launch on `device`: each one's
    programs start while the kernel before it finishes, load their first weights and wait
    (griddepcontrol.wait) before reading what that kernel wrote, so the gaps between the kernels
    of a decode step overlap; CUDA graphs keep it. Hopper (sm_90) and later, compiled kernels only."""
    if device.type != "cuda" or interpreted() or triton_version() is None:
        return False
    from llamactl.kernels.gdc import gdc_wait

    return gdc_wait is not None and capability(index(device)) >= (9, 0)


def pdl_launch(pdl: bool) -> dict:
    """A launch's arguments for `pdl`: the kernel's own PDL flag (its griddepcontrol code) and
    Triton's launch_pdl (the launch attribute). PDL is always passed, so autotune keys always
    hold it (kernel specializations are the same either way)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
