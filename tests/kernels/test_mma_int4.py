"""kernels.mma_int4: the tensor-core int4 product's layout (on any machine: `emulate` reads the packed
codes fragment by fragment as the kernel does, against the dense float64 product) and the kernel
itself on a GPU, under every row count up to 64 and several group sizes."""

from __future__ import annotations

import pytest
import torch

from llamactl.kernels import mma_int4 as mi


def _layer(n: int, k: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen).float()
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(torch.bfloat16).float()
    return codes, zeros, scales


def _dense(codes, zeros, scales, group) -> torch.Tensor:
    cols = torch.arange(codes.shape[1]) // group
    return (codes.double() - zeros.t()[:, cols].double()) * scales.t()[:, cols].double()  # [N, K]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(128, 128, 128), (256, 384, 128), (128, 256, 64), (128, 256, 32), (128, 512, 256)])
def test_the_packed_layout_read_as_the_kernel_reads_it_is_the_layer(n, k, group, dtype):
    codes, zeros, scales = _layer(n, k, group)
    qw, sz = mi.pack(codes, zeros, scales, group, dtype)
    assert qw.shape == (n // 8, k // 128, 32, 4) and qw.dtype == sz.dtype == torch.int32
    x = torch.randn(5, k).to(dtype)
    want = x.double() @ _dense(codes, zeros, scales, group).t()
    got = mi.emulate(x, qw, sz, group, dtype)
    # the weights rounded to dtype once ((q - z) * s), the sums in float32
    assert torch.allclose(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().mean().item())
    assert (got.double() - want).abs().mean() < 4e-3 * want.abs().mean()


def test_one_nibble_lands_on_its_own_weight():
    """A single code 1 among zeros, at each of a chunk's columns for one output: the emulated
    product with a one-hot x finds it at that column and nowhere else."""
    n, k, group = 128, 128, 128
    zeros, scales = torch.zeros(1, n), torch.ones(1, n)
    for col in (0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 127):
        codes = torch.zeros(n, k, dtype=torch.long)
        codes[13, col] = 1
        qw, sz = mi.pack(codes, zeros, scales, group, torch.float16)
        y = mi.emulate(torch.eye(k)[col : col + 1], qw, sz, group, torch.float16)  # [1, N]
        assert y[0, 13] == 1 and y.abs().sum() == 1, col


def test_shapes_the_kernel_does_not_take_are_refused():
    assert not mi.supported(4096 + 8, 4096, 128) and not mi.supported(4096, 4000, 128)
    assert not mi.supported(4096, 4096, 16) and mi.supported(11008 // 86 * 86, 11008, 128)
    with pytest.raises(ValueError, match="mma_int4.pack"):
        mi.pack(torch.zeros(100, 128, dtype=torch.long), torch.zeros(1, 100), torch.ones(1, 100), 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("n,k,group", [(256, 512, 128), (384, 1280, 64), (128, 4096, 128)])
def test_the_kernel_computes_what_the_layout_says(m, n, k, group, dtype):
    reason = mi.available()
    assert reason is None, reason
    codes, zeros, scales = _layer(n, k, group, seed=m)
    qw, sz = mi.pack(codes, zeros, scales, group, dtype)
    x = torch.randn(m, k).to(dtype)
    want = mi.emulate(x, qw, sz, group, dtype)
    got = mi.mma_int4(x.cuda(), qw.cuda(), sz.cuda(), group).float().cpu()
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().mean().item()), (got - want).abs().max()


def test_an_int4_layer_lays_its_codes_out_for_the_kernel_as_pack_does():
    """TritonInt4Linear.use_mma reads its codes back from the GEMV's layout (scales in fp16, zeros
    in uint8) into the kernel's: the same words as packing the codes directly; off frees them."""
    from llamactl.layers.int4 import TritonInt4Linear

    codes, zeros, scales = _layer(256, 384, 128, seed=3)
    lin = TritonInt4Linear(codes, zeros, scales, None, 128, None, torch.device("cpu"))
    lin.use_mma(True)
    qw, sz = mi.pack(codes, zeros, scales.half().float(), 128)
    assert torch.equal(lin.mma[0], qw) and torch.equal(lin.mma[1], sz) and lin.mma_dtype == torch.bfloat16
    lin.use_mma(True, torch.float16)  # laid out again for fp16 activations: other scale bits
    assert torch.equal(lin.mma[1], mi.pack(codes, zeros, scales.half().float(), 128, torch.float16)[1])
    assert lin.product(8) == "int4 tensor-core MMA" and lin.product(1) == "int4 GEMV"
    lin.use_mma(False)
    assert lin.mma is None and lin.product(8) != "int4 tensor-core MMA"
