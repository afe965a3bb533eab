"""The LLAMACTL_* on/off switches, read strictly, and environment variables set for the length of a
block (those switches, Inductor's cache dir)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from llamactl.errors import InputError

# LLAMACTL_QUANT_INPUTS (--quant-inputs): what the low-bit GEMVs multiply with; for all but "float",
# what the GEMV label (kernels.linear.set_kernels) and bench's stage names say when they ran
QUANT_INPUT_LABELS = {"int8": "int8 inputs", "fp16": "fp16 arithmetic", "int16": "int16 inputs"}
QUANT_INPUTS = ("float", *QUANT_INPUT_LABELS)


def flag(name: str, default: bool | None) -> bool | None:
    """An on/off switch: 1 or 0, `default` when unset; anything else is refused (a typo such as
    `on` would otherwise silently mean off)."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise InputError(f"{name}={value!r} is not 0 or 1", f"set {name}=1 (on) or {name}=0 (off), or unset it")
    return value == "1"


def choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """A switch with named values: one of `allowed`, `default` when unset; anything else is refused."""
    value = os.environ.get(name, default)
    if value not in allowed:
        raise InputError(f"{name}={value!r} is not one of {', '.join(allowed)}", f"use {' or '.join(allowed)}")
    return value


@contextmanager
def env_var(name: str, value: str | None) -> Iterator[None]:
    """os.environ[name] = value inside the block (None: left as it is), restored after it."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
