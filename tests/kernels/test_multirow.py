"""The multi-row products (kernels.multirow: 16-bit, int8 and int4 weights read once for a decode
batch) against float64. Without CUDA through Triton's interpreter (set in conftest)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_kernels import DEV, rel  # noqa: E402


@pytest.mark.parametrize("m,k", [(2, 256), (5, 576), (17, 256)])
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4-g64", "int4-g128"])
def test_multirow_products_match_float64(kind, m, k):
    """A decode batch's product (kernels.multirow), every weight read once for the rows: 16-bit,
    int8 per channel, int4 in kernels.gemv_int4's layout with groups of 64 and 128; rows past 16 take a
    larger tile (17: 32 rows, masked); 576 columns (a 135M model's width) end in a partial block.
    Groups of 128 take the split-K kernel (two splits under the interpreter), up to 16 rows by
    nibble planes and past 16 with the nibbles unpacked."""
    from llamactl.kernels import multirow
    from llamactl.kernels.int4_layout import dequantize_int4, pack_int4

    torch.manual_seed(m)
    n = 80
    if kind == "int4-g128" and k % 128:
        k = 640  # int4 widths are whole groups
    dt = torch.bfloat16  # what the layers run (the interpreter multiplies in float32)
    x = torch.randn(m, k, device=DEV, dtype=dt)
    if kind == "bf16":
        w = torch.randn(n, k, device=DEV, dtype=dt)
        got, ref = multirow.multirow_mm(x, w), x.double() @ w.double().t()
    elif kind == "int8":
        w = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
        s = torch.rand(n, device=DEV, dtype=dt) * 0.01
        got, ref = multirow.multirow_mm(x, w, s), (x.double() @ w.double().t()) * s.double()
    else:
        g = int(kind.split("-g")[1])
        q = pack_int4(torch.randint(0, 16, (n, k), device=DEV, dtype=torch.int32))
        s = torch.rand(n, k // g, device=DEV, dtype=torch.float16) * 0.01
        z = torch.randint(0, 16, (n, k // g), device=DEV, dtype=torch.uint8)
        got = multirow.multirow_int4(x, q, s, z, g)
        ref = x.double() @ dequantize_int4(q, s, z, g, torch.float32).double().t()
    assert got.shape == (m, n) and got.dtype == dt
    assert rel(got.cpu(), ref.cpu()) < 1e-2


def test_multirow_refuses_what_it_is_not_for():
    from llamactl.kernels import multirow

    w = torch.zeros(32, 64, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        multirow.multirow_mm(torch.zeros(65, 64, device=DEV, dtype=torch.float16), w)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        multirow.multirow_mm(torch.zeros(2, 32, device=DEV, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="G % 32"):
        multirow.multirow_int4(torch.zeros(2, 64, device=DEV, dtype=torch.float16),
                               torch.zeros(32, 8, device=DEV, dtype=torch.int32),
                               torch.zeros(32, 4, device=DEV, dtype=torch.float16),
                               torch.zeros(32, 4, device=DEV, dtype=torch.uint8), 16)
