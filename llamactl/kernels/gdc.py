"""Triton's grid dependency control (PTX griddepcontrol), which programmatic dependent launch
needs (see kernels.pdl): None where this Triton lacks it, and then PDL stays off."""

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the kernels run, without PDL
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait"]
