"""kernels.compiles.watch: a kernel variant first used while watching is reported (on a GPU, by a
real compile), a variant used before is not, and stopping restores the hook that was there."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402

from llamactl.kernels.compiles import watch  # noqa: E402


def test_watch_chains_the_hook_before_it_and_never_skips_a_launch():
    calls = []
    knobs.runtime.jit_cache_hook, before = (lambda **kw: calls.append(kw["repr"])), knobs.runtime.jit_cache_hook
    try:
        seen = []
        stop = watch(lambda name, variant: seen.append((name, variant)))
        fn = type("Fn", (), {"name": "_add"})()
        assert knobs.runtime.jit_cache_hook(fn=fn, repr="_add[num_warps=4](x_ptr: *fp32, n: i32)") is None
        assert seen == [("_add", "[num_warps=4](x_ptr: *fp32, n: i32)")]
        assert calls == ["_add[num_warps=4](x_ptr: *fp32, n: i32)"]
        stop()
        assert knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_cache_hook(repr="x") is None
        assert calls[-1] == "x" and len(seen) == 1
    finally:
        knobs.runtime.jit_cache_hook = before


@triton.jit
def _scale(x_ptr, n, BLOCK: tl.constexpr, FACTOR: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * FACTOR, mask=i < n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_variant_compiled_while_watching_is_reported_and_a_warm_one_is_not():
    x = torch.ones(100, device="cuda")
    _scale[(1,)](x, 100, BLOCK=128, FACTOR=2.0)  # warm: compiled before watching
    seen = []
    stop = watch(lambda name, variant: seen.append(name))
    try:
        _scale[(1,)](x, 100, BLOCK=128, FACTOR=2.0)
        assert seen == []
        _scale[(1,)](x, 100, BLOCK=128, FACTOR=3.0)  # a new constexpr: a new variant
        assert seen == ["_scale"]
    finally:
        stop()
    torch.cuda.synchronize()
    assert x[0].item() == 6.0
