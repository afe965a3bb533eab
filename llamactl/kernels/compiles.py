"""Kernels first used while a server runs. After the warm-up every Triton kernel a step launches
should be compiled (or loaded) already; one that is not (a shape or an argument specialization the
warm-up did not run) holds the step that meets it, and every request in that step, for its compile
(up to seconds on a GPU). `watch` calls back with each such kernel, so a server can count them and
say which.
"""

from __future__ import annotations

from typing import Callable


def watch(on_first_use: Callable[[str, str], None]) -> Callable[[], None] | None:
    """Call on_first_use(kernel name, its specialization, trimmed) each time Triton compiles or loads
    a kernel variant this process has not run yet; returns a function that stops watching, or None
    where Triton is absent (nothing to watch)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    before = knobs.runtime.jit_cache_hook

    def hook(**kw):
        fn, text = kw.get("fn"), kw.get("repr", "")
        name = getattr(fn, "name", None) or text.split("[", 1)[0]
        on_first_use(name, text[len(name):][:240])
        return before(**kw) if before is not None else None  # (a true value would skip the launch)

    knobs.runtime.jit_cache_hook = hook
    return lambda: setattr(knobs.runtime, "jit_cache_hook", before)
