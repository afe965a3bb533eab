"""Triton's grid dependency control (PTX griddepcontrol), which programmatic dependent launch
needs (see kernels.pdl): None where this Triton lacks it, and then PDL stays off."""

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the kernels run, without PDL
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait", "wait_for_previous"]


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """PDL (programmatic dependent launch): the program may have started while the kernel before
    it in the stream still ran; wait for that kernel to finish (its writes visible) before reading
    what it wrote or storing anything, then let the next kernel start launching (not before: one
    kernel waits at a time). Loads of what nothing writes (weights) may come before. No-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
