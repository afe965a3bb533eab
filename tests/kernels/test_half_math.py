"""The int4 and int8 GEMVs in packed fp16 arithmetic (H16, LLAMACTL_QUANT_INPUTS=fp16:
kernels.half_math) against float64 references. Without CUDA they run through Triton's
interpreter, with the fp16 arithmetic emulated where the GPU rounds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llamactl.kernels import gemv, gemv_int4  # noqa: E402
from test_kernels import DEV, _int4_case, gemv_prefetch, int4_prefetch, rel  # noqa: E402, F401


@pytest.mark.parametrize("k", [384, 1152])
@pytest.mark.slow
def test_gemv_int4_in_packed_fp16_is_close_to_float_even_with_a_massive_input(k, int4_prefetch):
    """h16: x scaled by a power of two per 32 columns to fp16, products summed in fp16 per quad:
    below bf16's output rounding (~1e-3) of the float64 product, with the folds, and with one
    input of 3000 (fp16 products of it unscaled would overflow: 15 x 3000 x 32 > 65504)."""
    n, g = 24, 128
    q, s, z, w = _int4_case(n, k, g, seed=k)
    x, nw, r = torch.randn(k, device=DEV), torch.rand(k, device=DEV) + 0.5, torch.randn(n, device=DEV)
    assert rel(gemv_int4.gemv_int4(x, q, s, z, g, inputs="fp16").cpu(), (w @ x.double()).cpu()) < 1e-3
    x[5] = 3000.0
    assert rel(gemv_int4.gemv_int4(x, q, s, z, g, inputs="fp16").cpu(), (w @ x.double()).cpu()) < 1e-3
    y = gemv_int4.gemv_int4(x, q, s, z, g, nw, 1e-5, r, False, inputs="fp16")
    ref = w @ (x.double() * torch.rsqrt(x.double().pow(2).mean() + 1e-5) * nw.double()) + r.double()
    assert rel(y.cpu(), ref.cpu()) < 1e-3
    h = torch.randn(2 * k, device=DEV)
    y = gemv_int4.gemv_int4(h, q, s, z, g, glu=True, inputs="fp16")
    assert rel(y.cpu(), (w @ (F.silu(h[:k].double()) * h[k:].double())).cpu()) < 1e-3
    assert not gemv_int4.gemv_int4(torch.zeros(k, device=DEV), q, s, z, g, inputs="fp16").any()  # a block of zeros: 0, not NaN
    with pytest.raises(ValueError, match="not one of"):
        gemv_int4.gemv_int4(x, q, s, z, g, inputs="fp8")


@pytest.mark.slow
def test_gemv_int8_in_packed_fp16_is_close_to_float_even_with_a_massive_input(gemv_prefetch):
    """h16 with int8 weights: x scaled per 32 columns to fp16, sums of 16 products a thread in
    fp16; below bf16's output rounding, with the folds and an input of 3000."""
    torch.manual_seed(4)
    n, k = 24, 1056
    w8 = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
    s8 = torch.rand(n, device=DEV) * 0.01 + 1e-3
    x, nw, r = torch.randn(k, device=DEV), torch.rand(k, device=DEV) + 0.5, torch.randn(n, device=DEV)
    ref = (w8.double() @ x.double()) * s8.double()
    assert rel(gemv.gemv(x, w8, s8, inputs="fp16").cpu(), ref.cpu()) < 1e-3
    x[40] = 3000.0
    assert rel(gemv.gemv(x, w8, s8, inputs="fp16").cpu(), ((w8.double() @ x.double()) * s8.double()).cpu()) < 1e-3
    y = gemv.gemv(x, w8, s8, nw, 1e-5, r, inputs="fp16")
    xn = x.double() * torch.rsqrt(x.double().pow(2).mean() + 1e-5) * nw.double()
    assert rel(y.cpu(), ((w8.double() @ xn) * s8.double() + r.double()).cpu()) < 1e-3
    assert not gemv.gemv(torch.zeros(k, device=DEV), w8, s8, inputs="fp16").any()
    with pytest.raises(ValueError, match="not one of"):
        gemv.gemv(x, w8, s8, inputs="fp8")
    with pytest.raises(ValueError, match="whole 32-column"):
        gemv.gemv(x[:1000], w8[:, :1000], s8, inputs="fp16")
