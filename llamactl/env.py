"""Environment variables set for the length of a block (the LLAMACTL_* switches, Inductor's cache dir)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


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
