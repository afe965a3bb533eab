"""The int4 and int8 GEMVs with 16-bit fixed-point inputs (I16, LLAMACTL_QUANT_INPUTS=int16: x
scaled by a power of two per 32 columns and rounded to int16, DP2A: kernels.int16_inputs) against
exact references. Without CUDA they run through Triton's interpreter, with DP2A emulated in
integers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llamactl.kernels import gemv, gemv_int4  # noqa: E402
from test_kernels import DEV, _fixed, _int4_case, _int8_per_32, gemv_prefetch, int4_prefetch, rel  # noqa: E402, F401


def _int16_per_32(x: torch.Tensor) -> torch.Tensor:
    """x [K] float32 as the I16 kernels read it, in float64: per 32 columns, with 2^e <= max |x| <
    2^(e + 1) (e >= -112), x * 2^(14 - e) rounded to an integer (ties to even), at most 32767,
    times 2^(e - 14)."""
    xb = x.double().view(-1, 32)
    amax = xb.abs().amax(1, keepdim=True)
    e = torch.floor(torch.log2(amax.clamp_min(2.0**-112)))
    return (torch.round(xb * 2.0 ** (14 - e)).clamp(max=32767) * 2.0 ** (e - 14)).view(-1)


def test_the_reference_rounds_only_what_int16_cannot_hold():
    """bf16 inputs within 2^7 of their block's largest are exact; smaller ones move by at most
    2^-15 of the largest."""
    x = torch.randn(4096).to(torch.bfloat16).double()
    x[7] = 3000.0
    xr = _int16_per_32(x.float())
    amax = x.view(-1, 32).abs().amax(1, keepdim=True)
    near = x.view(-1, 32).abs() >= amax / 2**7
    assert torch.equal(xr.view(-1, 32)[near], x.view(-1, 32)[near])
    assert ((xr - x).view(-1, 32).abs() <= amax * 2.0**-15).all()


@pytest.mark.parametrize("n,k,g", [(24, 256, 128), (20, 512, 64), (8, 640, 128)])
@pytest.mark.slow
def test_gemv_int4_i16_multiplies_its_inputs_exactly(n, k, g, int4_prefetch):
    """int16: the integer products (DP2A on the GPU) of the codes and x in 16-bit fixed point per
    32 columns equal the dequantized weights times that x, up to float32 rounding; against x as
    it is, within 1e-4 (float32 x: ~3e-5), 3e-4 with an outlier of 3000 among inputs near 1 (its block's
    others are rounded to multiples of 3000 / 2^14)."""
    q, s, z, w = _int4_case(n, k, g, seed=n + 3)
    x = torch.randn(k, device=DEV, dtype=torch.float32)
    x[32:64] = 0  # a quad of zeros
    assert rel(gemv_int4.gemv_int4(x, q, s, z, g, inputs="int16").cpu(), (w @ x.double()).cpu()) < 1e-4
    x[70] = 3000.0
    y = gemv_int4.gemv_int4(x, q, s, z, g, inputs="int16")
    assert rel(y.cpu(), (w @ _int16_per_32(x)).cpu()) < 1e-6
    assert rel(y.cpu(), (w @ x.double()).cpu()) < 3e-4
    assert not gemv_int4.gemv_int4(torch.zeros(k, device=DEV), q, s, z, g, inputs="int16").any()


@pytest.mark.parametrize("inputs,rounded,tol", [("int8", _int8_per_32, 1e-5), ("int16", _int16_per_32, 1e-6)])
def test_gemv_int4_integer_inputs_fold_rmsnorm_and_swiglu_before_rounding(inputs, rounded, tol, int4_prefetch):
    """int8 (A8) and int16 (I16) inputs: x' (after the folded RMSNorm or SwiGLU) is what is rounded."""
    n, k, g = 16, 384, 128
    q, s, z, w = _int4_case(n, k, g, seed=5)
    x, nw, r = torch.randn(k, device=DEV), torch.rand(k, device=DEV) + 0.5, torch.randn(n, device=DEV)
    y = gemv_int4.gemv_int4(x, q, s, z, g, nw, 1e-5, r, False, inputs=inputs)
    rs = torch.rsqrt(x.double().pow(2).mean() + 1e-5)
    assert rel(y.cpu(), (w @ rounded(x * nw) * rs + r.double()).cpu()) < tol
    h = torch.randn(2 * k, device=DEV)
    y = gemv_int4.gemv_int4(h, q, s, z, g, glu=True, inputs=inputs)
    act = (F.silu(h[:k].double()) * h[k:].double()).float()
    assert rel(y.cpu(), (w @ rounded(act)).cpu()) < tol


@pytest.mark.parametrize("n,k", [(24, 128), (13, 224), (40, 1056)])
@pytest.mark.slow
def test_gemv_int8_i16_multiplies_its_inputs_exactly(n, k, gemv_prefetch):
    """int16 with int8 weights: two DP2A a word (signed bytes), chained over a thread's 16 columns."""
    torch.manual_seed(n)
    w8 = torch.randint(-128, 128, (n, k), device=DEV, dtype=torch.int8)  # -128 too: DP2A takes signed bytes
    s8 = torch.rand(n, device=DEV) * 0.01 + 1e-3
    x = torch.randn(k, device=DEV)
    assert rel(gemv.gemv(x, w8, s8, inputs="int16").cpu(), ((w8.double() @ x.double()) * s8.double()).cpu()) < 1e-4
    x[3] = -3000.0
    y = gemv.gemv(x, w8, s8, inputs="int16")
    assert rel(y.cpu(), ((w8.double() @ _int16_per_32(x)) * s8.double()).cpu()) < 1e-6
    assert rel(y.cpu(), ((w8.double() @ x.double()) * s8.double()).cpu()) < 3e-4
    nw, r = torch.rand(k, device=DEV) + 0.5, torch.randn(n, device=DEV)
    y = gemv.gemv(x + 1, w8, s8, nw, 1e-5, r, False, inputs="int16")
    rs = torch.rsqrt((x.double() + 1).pow(2).mean() + 1e-5)
    assert rel(y.cpu(), ((w8.double() @ _int16_per_32((x + 1) * nw)) * rs * s8.double() + r.double()).cpu()) < 1e-6
    assert not gemv.gemv(torch.zeros(k, device=DEV), w8, s8, inputs="int16").any()
    with pytest.raises(ValueError, match="int16 inputs"):
        gemv.gemv(x[:100], w8[:, :100], s8, inputs="int16")


def test_an_input_that_rounds_to_2_15_is_held_at_32767():
    """A float32 input (an RMSNorm folded in) just under its block's next power of two scales to
    just under 2^15 and would round to 2^15, which int16 reads as -2^15: it is held at 32767."""
    n, k = 8, 64
    w8 = torch.ones(n, k, device=DEV, dtype=torch.int8)
    x = torch.zeros(k, device=DEV)
    x[0] = 2.0 - 2.0**-20  # 2^e = 1: scaled by 2^14 to 32768 - 2^-6
    y = gemv.gemv(x, w8, torch.ones(n, device=DEV), inputs="int16")
    assert torch.allclose(y.cpu().double(), torch.full((n,), 32767 * 2.0**-14, dtype=torch.float64))


@pytest.mark.parametrize("config", gemv._bf16_configs()[::3], ids=str)
@pytest.mark.slow
def test_int8_i16_candidates_compute_the_product(config, monkeypatch):
    torch.manual_seed(6)
    n, k = 40, 1056  # whole 32-column blocks, not whole config blocks
    monkeypatch.setattr(gemv, "FIXED_BLOCKS", True)
    monkeypatch.setattr(gemv, "GEMV_FIXED", _fixed(config))
    w8 = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
    s8 = torch.rand(n, device=DEV) * 0.01 + 1e-3
    x = torch.randn(k, device=DEV, dtype=torch.bfloat16).float()
    y = gemv.gemv(x, w8, s8, inputs="int16")
    assert rel(y.cpu(), ((w8.double() @ _int16_per_32(x)) * s8.double()).cpu()) < 1e-6


@pytest.mark.parametrize("config", gemv_int4._int4_configs()[::3], ids=str)
@pytest.mark.slow
def test_int4_i16_candidates_compute_the_product(config, monkeypatch):
    n, k, g = 72, 1152, 128  # 9 groups: K is no multiple of the 1024/2048-column blocks
    q, s, z, w = _int4_case(n, k, g, seed=7)
    monkeypatch.setattr(gemv, "FIXED_BLOCKS", True)
    monkeypatch.setattr(gemv_int4, "INT4_FIXED", _fixed(config))
    x = torch.randn(k, device=DEV, dtype=torch.bfloat16).float()
    y = gemv_int4.gemv_int4(x, q, s, z, g, inputs="int16")
    assert rel(y.cpu(), (w @ _int16_per_32(x)).cpu()) < 1e-6
