"""The swapped-operand products for decode batches (kernels.skinny: weights first, int4 by the
magic-number decode, K shared by programs that add their shares in a fixed order) against
float64. Without CUDA through Triton's interpreter (set in conftest), with two shares of K."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from llamactl.runtime.kv_cache import StaticCache

pytest.importorskip("triton")

from test_kernels import DEV, rel  # noqa: E402


@pytest.fixture(autouse=True)
def _few_configs(monkeypatch):
    """On a GPU, two autotuner configs a kernel (one split of K and two, both int4 decodes): each
    shape here would otherwise time them all, minutes in all (docs/bench/README.md)."""
    if DEV == "cuda":
        from llamactl.kernels import skinny

        for tuned in (skinny._w16_tuned, skinny._w8_tuned, skinny._w4_tuned, skinny._w4i8_tuned):
            monkeypatch.setattr(tuned, "configs", tuned.configs[:2])


def _int4(n, k, g):
    from llamactl.kernels.int4_layout import pack_int4

    codes = torch.randint(0, 16, (n, k), device=DEV, dtype=torch.int32)
    s = torch.rand(n, k // g, device=DEV, dtype=torch.float16) * 0.01
    z = torch.randint(0, 16, (n, k // g), device=DEV, dtype=torch.uint8)
    w = (codes.double() - z.double().repeat_interleave(g, 1)) * s.double().repeat_interleave(g, 1)  # [N, K]
    return pack_int4(codes), s, z, w


@pytest.mark.parametrize("m", [2, 17])
@pytest.mark.parametrize("kind", ["bf16", "fp16", "int8", "int4-g128", "int4-g256"])
def test_skinny_products_match_float64(kind, m):
    """x w^T for 2-17 rows (17: a 32-row tile, masked), 80 columns (a partial column block)."""
    from llamactl.kernels import skinny

    torch.manual_seed(m)
    n, k = 80, 512
    dt = torch.float16 if kind == "fp16" else torch.bfloat16
    x = torch.randn(m, k, device=DEV, dtype=dt)
    if kind.startswith("int4"):
        g = int(kind.split("-g")[1])
        q, s, z, w = _int4(n, k, g)
        got = skinny.skinny_int4(x, q, s, z, g)
    elif kind == "int8":  # codes exact in x's dtype, each row's scale on its float32 sums
        codes = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
        s = torch.rand(n, device=DEV, dtype=dt) * 0.01
        got = skinny.skinny_mm(x, codes, scales=s)
        w = codes.double() * s.double()[:, None]
    else:
        w = torch.randn(n, k, device=DEV, dtype=dt) * 0.05
        got = skinny.skinny_mm(x, w)
    ref = x.double() @ w.double().t()
    assert got.shape == (m, n) and got.dtype == dt
    assert rel(got.cpu(), ref.cpu()) < 1e-2


def _fixed16(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as skinny_int8 multiplies it, float64: each row's 128-column block scaled by
    2^(13 - e), 2^e <= max |x| < 2^(e + 1), rounded to the nearest integer (ties to even), scaled back."""
    m, k = x.shape
    blocks = F.pad(x.double(), (0, -k % 128)).view(m, -1, 128)  # [M, B, 128]
    e = torch.frexp(blocks.abs().amax(-1, keepdim=True))[1] - 1  # [M, B, 1]
    scale = torch.pow(2.0, (13 - e).double().clamp(max=126))
    return (torch.round(blocks * scale) / scale).view(m, -1)[:, :k]


@pytest.mark.parametrize("m", [3, 17])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_skinny_int8_multiplies_x_in_16_bit_fixed_point(dt, m):
    """skinny_int8: int8 weights on the integer MMA, x in 16-bit fixed point a 128-column block
    (the batch-1 GEMVs' int16 inputs) as two int8 operands: the product of that x (float64)
    within the output's rounding; 200 columns: a partial block; SwiGLU and the residual folded
    (checked in fp16: the interpreter rounds bf16 by truncation where the GPU rounds to nearest)."""
    from llamactl.kernels import skinny

    torch.manual_seed(m)
    n, k = 80, 200
    x = torch.randn(m, k, device=DEV, dtype=dt)
    x[0, 5] = 300.0  # one large input: the row's first block's small inputs lose low bits
    codes = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8)
    s = torch.rand(n, device=DEV, dtype=torch.bfloat16) * 0.01
    w = codes.double() * s.double()[:, None]
    got = skinny.skinny_int8(x, codes, s)
    assert got.shape == (m, n) and got.dtype == dt
    assert rel(got.cpu(), (_fixed16(x.cpu()) @ w.cpu().t())) < 1e-2
    if dt != torch.float16:
        return
    h = torch.randn(m, 2 * k, device=DEV, dtype=dt)
    r = torch.randn(m, n, device=DEV, dtype=dt)
    folded = skinny.skinny_int8(h, codes, s, r, glu=True)
    assert torch.equal(folded, r + skinny.skinny_int8(F.silu(h[:, :k]) * h[:, k:], codes, s))


@pytest.mark.parametrize("m,g", [(3, 128), (17, 256)])
def test_skinny_int4_i8_multiplies_codes_on_the_int8_mma(m, g):
    """skinny_int4_i8: int4 codes as int8 MMA operands (even columns c, odd ones 16 (c - 8)), x in
    skinny_int8's 16-bit fixed point: the product of that x (float64) within the output's rounding,
    including a large input that rounds its block's small ones; SwiGLU and the residual folded
    (fp16, as above)."""
    from llamactl.kernels import skinny

    torch.manual_seed(m)
    n, k = 80, 512
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    x[0, 5] = 300.0
    q, s, z, w = _int4(n, k, g)
    z[0] = 15  # the largest zero point: dot(code - zero, v) stays exact in int32
    w = (_unpack(q).double() - z.double().repeat_interleave(g, 1)) * s.double().repeat_interleave(g, 1)
    got = skinny.skinny_int4_i8(x, q, s, z, g)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert rel(got.cpu(), _fixed16(x.cpu()) @ w.cpu().t()) < 1e-2
    h = torch.randn(m, 2 * k, device=DEV, dtype=torch.float16)
    r = torch.randn(m, n, device=DEV, dtype=torch.float16)
    folded = skinny.skinny_int4_i8(h, q, s, z, g, r, glu=True)
    assert torch.equal(folded, r + skinny.skinny_int4_i8(F.silu(h[:, :k]) * h[:, k:], q, s, z, g))


def _unpack(q: torch.Tensor) -> torch.Tensor:
    """kernels.gemv's int32 words [N, K // 8] -> codes [N, K] (nibble j of word i: column 8 i + j)."""
    return torch.stack([(q >> (4 * j)) & 0xF for j in range(8)], dim=-1).reshape(q.shape[0], -1)


def test_skinny_int8_drops_inputs_under_its_fixed_point():
    """An input under 2^-14 of its block's largest is rounded to zero (the float path keeps it)."""
    from llamactl.kernels import skinny

    x = torch.full((2, 128), 0.01, device=DEV, dtype=torch.bfloat16)
    x[:, 0] = 1024.0  # scale 2^(13 - 10): 0.01 * 8 rounds to 0
    codes = torch.ones(32, 128, device=DEV, dtype=torch.int8)
    codes[:, 0] = 0
    s = torch.ones(32, device=DEV, dtype=torch.bfloat16)
    assert float(skinny.skinny_mm(x, codes, scales=s).float().abs().min()) > 1.2
    assert float(skinny.skinny_int8(x, codes, s).float().abs().max()) == 0.0


@pytest.mark.parametrize("kind", ["fp16", "int4"])
def test_skinny_folds_swiglu_and_the_residual(kind):
    """glu: the input is [gate; up] and silu(gate) * up is multiplied (PyTorch's roundings); the
    residual is added to the rounded product, as residual + linear(x) rounds. fp16: the
    interpreter rounds bf16 by truncation where the GPU rounds to nearest."""
    from llamactl.kernels import skinny

    torch.manual_seed(0)
    dt = torch.float16
    m, n, k = 3, 64, 256
    h = torch.randn(m, 2 * k, device=DEV, dtype=dt)
    r = torch.randn(m, n, device=DEV, dtype=dt)
    x = F.silu(h[:, :k]) * h[:, k:]
    if kind == "int4":
        q, s, z, w = _int4(n, k, 128)
        plain, folded = skinny.skinny_int4(x, q, s, z, 128), skinny.skinny_int4(h, q, s, z, 128, r, glu=True)
    else:
        w = torch.randn(n, k, device=DEV, dtype=dt) * 0.05
        plain, folded = skinny.skinny_mm(x, w), skinny.skinny_mm(h, w, r, glu=True)
    assert torch.equal(folded, r + plain)
    assert rel(plain.cpu(), (x.double() @ w.double().t()).cpu()) < 1e-2


@pytest.mark.skipif(DEV == "cuda", reason="the GPU's autotuner picks the decode; the interpreter takes either")
def test_skinny_int4_decodes_by_planes_or_joined():
    """The two int4 decodes the autotuner chooses between: 8 planes of K=16 dots, or the planes
    joined into one 128-column operand (x loaded in the joins' column order): the same product."""
    from llamactl.kernels import skinny

    torch.manual_seed(2)
    x = torch.randn(5, 256, device=DEV, dtype=torch.bfloat16)
    q, s, z, w = _int4(48, 256, 128)
    ref = x.double() @ w.t()
    for join in (True, False):
        got = skinny._launch(skinny._w4_kernel, None, x, (q, s, z), 48, 256, None, False, {"G": 128, "JOIN": join})
        assert rel(got, ref) < 1e-2


def test_skinny_repeats_its_bits_and_leaves_counters_at_zero():
    """The shares of K are added in a fixed order by the last program of a block: the same bits
    every call, and the counters back at zero for the next launch."""
    from llamactl.kernels import skinny

    torch.manual_seed(1)
    x = torch.randn(4, 512, device=DEV, dtype=torch.float16)
    w = torch.randn(96, 512, device=DEV, dtype=torch.float16)
    first = skinny.skinny_mm(x, w)
    for _ in range(3):
        assert torch.equal(skinny.skinny_mm(x, w), first)
    assert int(skinny._counters[x.device].abs().sum()) == 0


def test_skinny_refuses_what_it_is_not_for():
    from llamactl.kernels import skinny

    w = torch.zeros(32, 64, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        skinny.skinny_mm(torch.zeros(65, 64, device=DEV, dtype=torch.float16), w)
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        skinny.skinny_mm(torch.zeros(2, 64, device=DEV, dtype=torch.float16), w, glu=True)
    with pytest.raises(ValueError, match="fp16 or bf16 rows"):
        skinny.skinny_mm(torch.zeros(2, 64, device=DEV), w.float())
    with pytest.raises(ValueError, match="a weight of x's dtype"):
        skinny.skinny_mm(torch.zeros(2, 64, device=DEV, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="multiple of 128"):
        skinny.skinny_int4(torch.zeros(2, 512, device=DEV, dtype=torch.float16),
                           torch.zeros(32, 64, device=DEV, dtype=torch.int32),
                           torch.zeros(32, 8, device=DEV, dtype=torch.float16),
                           torch.zeros(32, 8, device=DEV, dtype=torch.uint8), 64)


@pytest.mark.parametrize("weights,swiglu", [("fp16", "down"), ("int4", "gate_up"), ("int8", "down")])
@pytest.mark.slow
def test_a_decode_batch_runs_the_skinny_products_with_the_steps_folded(tmp_path, weights, swiglu):
    """A 3-row decode step of a prepared fp16 model takes kernels.skinny (16-bit, int8 and int4 g128 layers,
    the norm before, SwiGLU at either site and the residual folded in) and gives the logits of the
    same step with the kernels off (cuBLAS/torch), within the products' rounding."""
    from conftest import make_hf_model
    from llamactl.folder.artifact import open_artifact
    from llamactl.layers.plan import prepare, products
    from llamactl.runtime.load import load_model
    from llamactl.options import RuntimeOptions
    from llamactl.layers.rtn import quantize_linears_int4, quantize_linears_int8

    path = make_hf_model(tmp_path / "m", hidden=128, heads=4, kv_heads=2, vocab=512)
    model = load_model(open_artifact(path), torch.device(DEV), torch.float16)
    if weights == "int4":
        assert quantize_linears_int4(model, True, 128) == 2 * 7
    if weights == "int8":
        assert quantize_linears_int8(model, True) == 2 * 7
    cache = StaticCache.for_model(model, 3, 32)
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (3, 9), device=DEV)
    options = RuntimeOptions(swiglu=swiglu)

    def run():  # an 8-token prefill of 3 rows (24 rows: past skinny's), then one 3-row decode step
        model(ids[:, :8], torch.arange(8, device=DEV), cache)
        return model(ids[:, 8:], torch.tensor([8], device=DEV), cache)[:, -1].float()

    prepare(model, options.replace(kernels=False), interpreter=True)
    ref = run()
    prepare(model, options, interpreter=True)
    kind = {"int4": "int4 skinny", "int8": "int8 skinny"}.get(weights, "16-bit skinny")
    assert kind in products(model, 3) and kind not in products(model, 33)
    assert rel(run(), ref.double()) < 1e-2


def test_a_float32_model_keeps_its_exact_products(tmp_path):
    """float32 rows would multiply in TF32 on the skinny kernels: a float32 model's batches stay on
    torch's products, and the bench rows say so."""
    from conftest import make_hf_model
    from llamactl.folder.artifact import open_artifact
    from llamactl.layers.plan import prepare, products
    from llamactl.runtime.load import load_model

    model = load_model(open_artifact(make_hf_model(tmp_path / "m", vocab=512)), torch.device(DEV), torch.float32)
    prepare(model, interpreter=True)
    assert products(model, 1) == "16-bit GEMV" and products(model, 3) == "16-bit cuBLAS"


@pytest.mark.skipif(DEV != "cuda", reason="programmatic dependent launch needs a GPU (the interpreter has no PTX)")
def test_skinny_dependent_launches_give_the_same_bits():
    """pdl: each product a programmatic dependent launch of the one before (first weights read
    before waiting), chained as a decode step chains them, in a CUDA graph: the bits of plain launches."""
    from llamactl.kernels import skinny
    from llamactl.kernels.device import pdl_supported
    from llamactl.kernels.glue import rms_norm, silu_mul

    if not pdl_supported(torch.device(DEV)):
        pytest.skip("this GPU has no programmatic dependent launch")
    torch.manual_seed(0)
    m, n, k = 8, 512, 1024
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    nw = torch.rand(k, device=DEV, dtype=torch.bfloat16)
    w1 = torch.randn(2 * n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(k, n, device=DEV, dtype=torch.bfloat16) * 0.05
    q, s, z, _ = _int4(k, k, 128)

    def chain(pdl):  # norm -> gate_up -> SwiGLU -> down (+ x) -> int4 (+ x)
        h = skinny.skinny_mm(rms_norm(x, nw, 1e-5, pdl), w1, pdl=pdl)
        y = skinny.skinny_mm(silu_mul(h, pdl), w2, x, pdl=pdl)
        return skinny.skinny_int4_i8(y, q, s, z, 128, x, pdl=pdl)

    plain = chain(False)
    assert torch.equal(chain(True), plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
