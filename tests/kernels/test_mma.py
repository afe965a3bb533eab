"""kernels.mma: the tensor-core int4, int8 and FP8 products' layouts (on any machine: `emulate` reads the
packed codes fragment by fragment as the kernel does, against the dense float64 product); the CUDA
source itself on the CPU (tests/kernels/mma_host.cpp emulates its GPU steps from the PTX ISA) and
compiled by nvcc where one is installed; and the kernels on a GPU, under every row count up to 64
and several group sizes."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from llamactl.kernels import mma as mi


def _layer(n: int, k: int, group: int, seed: int = 0, kind: str = "int4"):
    """(codes, zeros, scales) of a random layer: GPTQ-style codes, or FP8's e4m3 weights (every
    finite value, subnormals among them) with no zeros."""
    gen = torch.Generator().manual_seed(seed)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).to(torch.bfloat16).float()
    if kind == "fp8":
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x42  # not the two NaNs
        return codes.view(torch.float8_e4m3fn), None, scales
    bits = mi.KINDS[kind]
    codes = torch.randint(0, 2**bits, (n, k), generator=gen)
    zeros = torch.randint(0, 2**bits, (k // group, n), generator=gen).float()
    return codes, zeros, scales


def _dense(codes, zeros, scales, group) -> torch.Tensor:
    cols = torch.arange(codes.shape[1]) // group
    if zeros is None:  # fp8
        return codes.double() * scales.t()[:, cols].double()
    return (codes.double() - zeros.t()[:, cols].double()) * scales.t()[:, cols].double()  # [N, K]


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group", [(128, 128, 128), (256, 384, 128), (128, 256, 64), (128, 256, 32), (128, 512, 256)])
def test_the_packed_layout_read_as_the_kernel_reads_it_is_the_layer(n, k, group, dtype, kind):
    codes, zeros, scales = _layer(n, k, group, kind=kind)
    qw, sz = mi.pack(codes, zeros, scales, group, dtype, kind)
    assert qw.shape == (n // 8, k // 128, 8 * mi.KINDS[kind], 4) and qw.dtype == sz.dtype == torch.int32
    x = torch.randn(5, k).to(dtype)
    want = x.double() @ _dense(codes, zeros, scales, group).t()
    got = mi.emulate(x, qw, sz, group, dtype, kind)
    # the weights rounded to dtype once ((q - z) * s), the sums in float32
    assert torch.allclose(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().mean().item())
    assert (got.double() - want).abs().mean() < 4e-3 * want.abs().mean()


@pytest.mark.parametrize("kind,dtype", [("int4", torch.float16), ("int8", torch.float16), ("int8", torch.bfloat16),
                                        ("fp8", torch.bfloat16), ("fp8", torch.float16)])
def test_one_code_lands_on_its_own_weight(kind, dtype):
    """A single code among zeros, at each of a chunk's columns for one output: the emulated
    product with a one-hot x finds it at that column and nowhere else."""
    n, k, group = 128, 256, 128
    zeros, scales = (None if kind == "fp8" else torch.zeros(2, n)), torch.ones(2, n)
    top = 448 if kind == "fp8" else 2 ** mi.KINDS[kind] - 1
    for col in (0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 127, 128, 201, 255):
        codes = torch.zeros(n, k, dtype=torch.float8_e4m3fn if kind == "fp8" else torch.long)
        codes[13, col] = top
        qw, sz = mi.pack(codes, zeros, scales, group, dtype, kind)
        y = mi.emulate(torch.eye(k)[col : col + 1], qw, sz, group, dtype, kind)  # [1, N]
        assert y[0, 13] == top and y.abs().sum() == top, col


def test_shapes_the_kernel_does_not_take_are_refused():
    assert not mi.supported(4096 + 8, 4096, 128) and not mi.supported(4096, 4000, 128)
    assert not mi.supported(4096, 4096, 16) and mi.supported(11008 // 86 * 86, 11008, 128)
    with pytest.raises(ValueError, match="mma.pack"):
        mi.pack(torch.zeros(100, 128, dtype=torch.long), torch.zeros(1, 100), torch.ones(1, 100), 128)
    with pytest.raises(ValueError, match="mma.pack: int3"):
        mi.pack(torch.zeros(128, 128, dtype=torch.long), torch.zeros(1, 128), torch.ones(1, 128), 128, kind="int3")
    with pytest.raises(ValueError, match="mma.pack: fp8"):  # FP8 has no zero points
        mi.pack(torch.zeros(128, 128, dtype=torch.long), torch.zeros(1, 128), torch.ones(1, 128), 128, kind="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("n,k,group", [(256, 512, 128), (384, 1280, 64), (128, 4096, 128), (256, 1024, 1024)])
def test_the_kernel_computes_what_the_layout_says(m, n, k, group, dtype, kind):
    reason = mi.available()
    assert reason is None, reason
    codes, zeros, scales = _layer(n, k, group, seed=m, kind=kind)
    qw, sz = mi.pack(codes, zeros, scales, group, dtype, kind)
    x = torch.randn(m, k).to(dtype)
    want = mi.emulate(x, qw, sz, group, dtype, kind)
    got = mi.mma(x.cuda(), qw.cuda(), sz.cuda(), group, kind).float().cpu()
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


def test_an_int8_layer_lays_its_rows_out_as_one_group_each():
    """Int8Kernel's signed per-channel rows: codes + 128 with zero 128 and one group the width, for
    bf16 activations whatever the model's dtype; the emulated product is the layer's."""
    from llamactl.layers.int8 import Int8Kernel

    gen = torch.Generator().manual_seed(4)
    weight = torch.randint(-127, 128, (256, 384), generator=gen, dtype=torch.int8)
    scales = torch.rand(256, generator=gen) * 0.01 + 0.001
    lin = Int8Kernel(weight, scales, None, triton=True)
    lin.use_mma(True, torch.float16)
    assert lin.mma_dtype == torch.bfloat16 and lin.mma[0].shape == (32, 3, 64, 4)
    x = torch.randn(3, 384)
    want = x.double() @ (weight.double() * lin.scales.double()[:, None]).t()
    got = mi.emulate(x, *lin.mma, 384, torch.bfloat16, "int8")
    assert (got.double() - want).abs().max() < 2e-2 * want.abs().mean()
    assert lin.product(8) == "int8 tensor-core MMA" and lin.product(1) == "int8 GEMV"
    lin.use_mma(False)
    assert lin.mma is None and lin.product(8) == "int8 multirow"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_every_variant_compiles_for_hopper_without_spills(tmp_path):
    """The CUDA source built as a GPU machine builds it (nvcc, sm_90): every variant the module
    launches is there, none spills registers to local memory."""
    done = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v", "-o", str(tmp_path / "mma.cubin"),
                           str(mi.SOURCE)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    compiled = re.findall(r"Compiling entry function '(\w+)'", done.stderr)
    assert sorted(compiled) == sorted(mi.VARIANTS) and len(mi.VARIANTS) == 18
    assert re.findall(r"(\d+) bytes spill stores", done.stderr) == ["0"] * len(mi.VARIANTS)


@pytest.fixture(scope="module")
def host_kernel(tmp_path_factory):
    """mma.cu built for the CPU with tests/kernels/mma_host.cpp's emulation of its GPU steps."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    lib = tmp_path_factory.mktemp("mma_host") / "mma_host.so"
    done = subprocess.run(["g++", "-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-Wno-unknown-pragmas", "-o",
                           str(lib), str(Path(__file__).with_name("mma_host.cpp"))], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return ctypes.CDLL(str(lib))


def _launch_on_host(lib, x, qw, sz, group, kind, split):
    """mma.mma's launch, run by the host emulation: (out [M, N] float32)."""
    m, k = x.shape
    n = qw.shape[0] * 8
    split, per = mi.spread(k // mi.CHUNK_K, split)
    out = torch.zeros(m, n, dtype=torch.float32)
    x, qw, sz = x.contiguous(), qw.contiguous(), sz.contiguous()
    name = mi.variant(kind, x.dtype, m).encode()
    rc = lib.launch(name, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(qw.data_ptr()), ctypes.c_void_p(sz.data_ptr()),
                    ctypes.c_void_p(out.data_ptr()), m, n, k, group, per, int(split > 1), n // mi.BLOCK_N, split)
    assert rc == 0
    return out


@pytest.mark.parametrize("kind,dtype,m,n,k,group,split", [
    ("int4", torch.bfloat16, 1, 256, 512, 128, 1), ("int4", torch.bfloat16, 17, 128, 512, 64, 4),
    ("int4", torch.float16, 33, 256, 256, 32, 2), ("int4", torch.float16, 64, 128, 384, 128, 3),
    ("int8", torch.bfloat16, 5, 256, 512, 512, 2), ("int8", torch.bfloat16, 32, 128, 256, 64, 1),
    ("int8", torch.float16, 16, 128, 384, 128, 3), ("int8", torch.float16, 50, 128, 256, 256, 1),
    ("fp8", torch.bfloat16, 3, 128, 512, 512, 2), ("fp8", torch.bfloat16, 40, 256, 256, 256, 1),
    ("fp8", torch.float16, 9, 128, 384, 384, 3), ("fp8", torch.float16, 64, 128, 256, 256, 2)])
def test_the_cuda_source_run_on_the_host_computes_what_the_layout_says(host_kernel, kind, dtype, m, n, k, group, split):
    """The kernel's own code (staging, fragments, dequantization, split-K, the output) under the
    host emulation of its GPU steps, against `emulate`: every row count's tile variant, both types
    and every kind of code, with and without the split."""
    codes, zeros, scales = _layer(n, k, group, seed=m, kind=kind)
    qw, sz = mi.pack(codes, zeros, scales, group, dtype, kind)
    x = torch.randn(m, k).to(dtype)
    want = mi.emulate(x, qw, sz, group, dtype, kind)
    got = _launch_on_host(host_kernel, x, qw, sz, group, kind, split)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().mean().item()), (got - want).abs().max()


def test_an_fp8_layer_lays_its_weights_out_as_they_are():
    """FP8Linear's e4m3 weights and per-channel scales: one group a row, the emulated product the
    layer's dequantized one; laid out for the model's dtype."""
    from llamactl.layers.fp8 import FP8Linear, quantize_fp8

    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(5)) * 0.02
    lin = FP8Linear(384, 256, bias=False)
    lin.weight, lin.weight_scale = quantize_fp8(w)
    lin.use_mma(True, torch.float16)
    assert lin.mma_dtype == torch.float16 and lin.mma[0].shape == (32, 3, 64, 4)
    x = torch.randn(4, 384)
    want = x.double() @ lin.dequantized(torch.float32).double().t()
    got = mi.emulate(x, *lin.mma, 384, torch.float16, "fp8")
    assert (got.double() - want).abs().max() < 1e-2 * want.abs().mean()
    assert lin.product(8) == "fp8 weights tensor-core MMA"
    lin.use_mma(False)
    assert lin.mma is None and lin.product(8) != "fp8 weights tensor-core MMA"


@pytest.mark.parametrize("quant,layer", [("int4", "TritonInt4Linear"), ("int8", "Int8Kernel"), ("fp8", "FP8Linear")])
def test_asking_for_the_kernel_where_it_cannot_run_warns_and_keeps_the_other_kernels(quant, layer):
    """RuntimeOptions.mma on a machine without a GPU (the Triton interpreter standing in for the
    kernels): the plan says why in one line and no layer lays out a second copy of its codes."""
    from llamactl.layers.plan import prepare
    from llamactl.options import RuntimeOptions
    from llamactl.runtime.synthetic import synthetic_model

    _, model = synthetic_model("tiny", quant, torch.device("cpu"), torch.bfloat16, "triton")
    plan = prepare(model, RuntimeOptions(mma=True), interpreter=True)
    layers = [m for m in model.modules() if type(m).__name__ == layer]
    assert layers and all(m.mma is None for m in layers)
    assert any("needs a CUDA GPU; low-bit decode batches keep their other kernels" in w for w in plan.warnings)
    assert not any("MMA" in w for w in prepare(model, RuntimeOptions(), interpreter=True).warnings)
