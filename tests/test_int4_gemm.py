"""The prompt-sized 4-bit product (kernels.int4_gemm) against float64, with 4-, 5- and 6-bit codes,
and the choice between it and dequantize + cuBLAS. Without CUDA through Triton's interpreter
(set in conftest)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_kernels import DEV, rel  # noqa: E402


def _layer(n: int, k: int, g: int, bits: int, seed: int = 0):
    """Random codes of `bits` bits in the int4 layout (the high plane as layers.planes splits it) and
    their float64 weight [n, k]."""
    from llamactl.kernels.int4_layout import pack_int4
    from llamactl.layers.planes import split_planes

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.int32)
    s = (torch.rand(n, k // g, generator=gen) * 0.01).to(torch.float16)
    z = torch.randint(0, 2**bits, (n, k // g), generator=gen, dtype=torch.int32).to(torch.uint8)
    grp = torch.arange(k) // g
    w = (codes.double() - z.double()[:, grp]) * s.double()[:, grp]  # [n, k]
    hi = split_planes(codes, bits)[1].to(DEV) if bits > 4 else None
    return (pack_int4(codes & 0xF).to(DEV), s.to(DEV), z.to(DEV), hi), w


@pytest.mark.parametrize("bits", (4, 5, 6))
@pytest.mark.parametrize("m,n,k,g", [(70, 80, 256, 64), (97, 48, 384, 128), (65, 96, 256, 32)])
def test_int4_gemm_matches_float64(bits, m, n, k, g):
    """Rows past the decode kernels' 64, in row blocks of 32 under the interpreter (three or four,
    so the programs' bands of two row blocks end short); columns not a multiple of the block
    (masked); groups of 32, 64 and 128 columns; 5 and 6 bits add the high plane's bits."""
    from llamactl.kernels.int4_gemm import int4_mm

    (q, s, z, hi), w = _layer(n, k, g, bits, seed=m)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    got = int4_mm(x.to(DEV), q, s, z, g, hi, bits - 4)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert rel(got.cpu(), x.double() @ w.t()) < 1e-2


def test_prefill_product_takes_the_kernel_up_to_its_rows_then_cublas(monkeypatch):
    """Up to gemm_rows the kernel; past it the dequantized layer on cuBLAS; both the same product."""
    from llamactl.kernels import int4_gemm

    (q, s, z, _), w = _layer(64, 256, 128, 4)
    x = torch.randn(80, 256, dtype=torch.float32).to(DEV)
    calls = []
    real = int4_gemm.int4_mm
    monkeypatch.setattr(int4_gemm, "int4_mm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    ref = x.double().cpu() @ w.t()
    for rows in (80, 79):
        y = int4_gemm.prefill_product(x, q, s, z, 128, gemm_rows=rows)
        assert rel(y.cpu(), ref) < 1e-5
    assert calls == [80]


def test_int4_gemm_refuses_what_it_cannot_multiply():
    from llamactl.kernels.int4_gemm import int4_mm

    (q, s, z, _), _ = _layer(32, 128, 64, 4)
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        int4_mm(torch.zeros(70, 64, device=DEV, dtype=torch.float16), q, s, z, 64)
    with pytest.raises(ValueError, match="G % 32"):
        int4_mm(torch.zeros(70, 128, device=DEV, dtype=torch.float16), q, s, z, 48)
