"""5- and 6-bit layers on the int4 GEMV (kernels.high_bits, layers.planes.Int4PlanesLinear): the
bit spreading for every value, the layer against float64 in each arithmetic, a fused model's decode
steps against the same layers unfused. Without CUDA through Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from llamactl.kernels.high_bits import spread  # noqa: E402
from llamactl.runtime.kv_cache import StaticCache
from test_planes import _layer  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _spread_kernel(h_ptr, out_ptr, n, HI: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(h_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + i, spread(h, HI), mask=i < n)


@pytest.mark.parametrize("hi", (1, 2))
def test_spread_puts_each_even_columns_high_bits_above_its_nibble(hi):
    """Every byte (5 bits) and half word (6 bits): even column 2 m's high bits land at bits 4 (, 5)
    of byte m and nothing else is set (the odd columns take the same after h >> hi)."""
    h = torch.arange(2 ** (8 * hi), dtype=torch.int32)
    got = torch.empty_like(h, device=DEV)
    _spread_kernel[(triton.cdiv(h.numel(), 1024),)](h.to(DEV), got, h.numel(), HI=hi, BLOCK=1024)
    want = sum(((h >> (2 * hi * m)) & ((1 << hi) - 1)) << (8 * m + 4) for m in range(4))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("bits", (5, 6))
@pytest.mark.parametrize("inputs,group", [("float", 64), ("int16", 128), ("int8", 64), ("fp16", 128)])
@pytest.mark.slow
def test_int4_planes_layer_computes_the_dequantized_product(bits, inputs, group):
    """One row on the int4 GEMV with the high plane (fp16 inputs fall back to float); 3 and 20 rows
    on the split-K kernel (groups of 128: nibble planes, then unpacked columns) or the plane kernel
    (64); 70 dequantized; against the GPTQ layer's float64 weight, in float32, so that the float and
    int16 arithmetic are checked near exactness."""
    from llamactl.layers.planes import Int4PlanesLinear, plane_layer

    lin = _layer(bits, out_f=96, in_f=384, group=group)
    fast = plane_layer(lin).to(DEV)
    assert isinstance(fast, Int4PlanesLinear) and fast.product(1) == f"int{bits} GEMV"
    assert fast.product(3) == f"int{bits} " + ("split-K" if group == 128 else "planes")
    fast.inputs = inputs
    w = lin.dequantized(torch.float64)  # [out, in]
    several = 1e-5 if DEV == "cpu" else 1e-2  # the GPU's split-K kernel multiplies float32 rows in tf32
    for rows, tol in ((1, {"int8": 1e-2, "int16": 1e-4}.get(inputs, 1e-5)), (3, several), (20, several), (70, 1e-5)):
        x = torch.randn(rows, lin.in_features)
        ref = x.double() @ w.t()
        y = fast(x.to(DEV)).double().cpu()
        assert float((y - ref).norm() / ref.norm()) < tol, (rows, inputs)


def test_a_short_last_group_and_layers_of_other_widths_do_not_concatenate():
    from llamactl.layers.int4 import TritonInt4Linear
    from llamactl.layers.planes import Int4PlanesLinear, plane_layer
    from llamactl.runtime.model import _concat

    short = plane_layer(_layer(5, out_f=32, in_f=96, group=64))  # groups of 64 over 96 columns: one of 32
    assert isinstance(short, Int4PlanesLinear) and short.pad == 32
    x = torch.randn(1, 96)
    ref = x.double() @ _layer(5, out_f=32, in_f=96, group=64).dequantized(torch.float64).t()
    assert float((short.to(DEV)(x.to(DEV)).double().cpu() - ref).norm() / ref.norm()) < 1e-5
    five, six = plane_layer(_layer(5, seed=1)), plane_layer(_layer(6, seed=2))
    assert _concat([five, six]) is None and _concat([five, plane_layer(_layer(5, seed=3))]) is not None
    four = TritonInt4Linear(torch.randint(0, 16, (96, 320)), torch.full((5, 96), 8), torch.ones(5, 96), None, 64,
                            None, torch.device("cpu"))
    assert _concat([four, five]) is None


@pytest.mark.slow
@pytest.mark.parametrize("bits,inputs", [(5, "int16")])  # 6 bits and float sums: the layer test above
def test_planes_model_with_fused_kernels_matches_the_unfused_path(tmp_path, bits, inputs):
    """A 5/6-bit model (RTN, group 32): q/k/v and gate/up concatenated, norms, SwiGLU and residuals
    folded into the GEMV, decodes like the same layers unfused."""
    from conftest import make_hf_model

    from llamactl.folder.artifact import open_artifact
    from llamactl.layers.plan import prepare, products
    from llamactl.layers.planes import Int4PlanesLinear
    from llamactl.runtime.load import load_model
    from llamactl.options import RuntimeOptions
    from llamactl.layers.rtn import quantize_linears_planes

    options = RuntimeOptions(quant_inputs=inputs)
    path = make_hf_model(tmp_path / "m", hidden=128, heads=4, kv_heads=2)
    model = load_model(open_artifact(path), torch.device(DEV), torch.float32)
    assert quantize_linears_planes(model, bits, 32, True) == 2 * 7
    model.fuse_projections()
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, Int4PlanesLinear)
    ids = torch.randint(0, 8192, (1, 12), device=DEV)

    def run():  # a 10-token prefill (the plane kernel), then 2 decode steps (the fused GEMVs)
        cache = StaticCache.for_model(model, 1, 32)
        out = [model(ids[:, :10], torch.arange(10, device=DEV), cache)[:, -1]]
        for p in range(10, 12):
            out.append(model(ids[:, p : p + 1], torch.tensor([p], device=DEV), cache)[:, -1])
        return torch.stack(out)

    prepare(model, options.replace(kernels=False), interpreter=True)
    ref = run()
    plan = prepare(model, options, interpreter=True)
    assert plan.inputs == inputs and model.model.layers[0].self_attn.qkv_proj.norm is not None
    assert f"int{bits} GEMV" in products(model, 1)
    torch.testing.assert_close(run(), ref, atol=1e-3, rtol=1e-3)
