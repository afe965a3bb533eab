"""llamactl's CPU kernels (kernels.cpu, layers.cpu) against float64 references."""

from __future__ import annotations

import pytest
import torch

from llamactl.kernels import cpu as kcpu
from llamactl.layers import cpu as lcpu
from llamactl.layers.gptq import GPTQLinear, pack_gptq
from llamactl.quantize.rtn import rtn_quantize

pytestmark = pytest.mark.skipif(lcpu.kernels_load() is not None, reason=f"CPU kernels unavailable: {lcpu.kernels_load()}")


def round_like_kernel(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded as qgemv rounds it: int8 per block of 32, scale amax / 127 (float64)."""
    xb = x.double().view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0)  # round half to even, as nearbyint
    return (q * d).view_as(x)


def layer(k: int, n: int, bits: int, group: int, act_order: bool = False, seed: int = 0):
    """A GPTQLinear with RTN codes of a random weight, and its float64 weight."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    codes, zeros, scales, g_idx = rtn_quantize(w, bits, group, sym=False)
    if act_order:  # a permuted group assignment, as GPTQ's act-order writes it
        perm = torch.randperm(k, generator=g)
        g_idx = g_idx[perm]
        codes = codes[:, torch.argsort(perm)]
        codes = torch.randint(0, 2**bits, (n, k), generator=g)
    lin = GPTQLinear(k, n, bits, group, bias=False, v1=False, planar=bits == 3)
    for name, t in pack_gptq(codes, zeros, scales, g_idx, bits, v1=False, planar=bits == 3).items():
        setattr(lin, name, torch.nn.Parameter(t, requires_grad=False) if name == "bias" else t)
        lin.register_buffer(name, t)
    return lin, lin.dequantized(torch.float64)


@pytest.mark.parametrize("k,n,bits,group,rows,act_order", [
    (384, 96, 4, 128, 1, False), (576, 80, 4, 128, 3, False),  # a short last group (576 = 4 * 128 + 64)
    (96, 40, 4, 32, 2, False),  # an odd number of blocks (the plain-loop tail)
    (192, 48, 4, 96, 1, False),  # groups that split a chunk of 64
    (256, 64, 8, 64, 8, False), (256, 64, 3, 128, 2, False), (256, 64, 5, 64, 1, False),
    (256, 64, 6, 128, 4, False), (128, 32, 2, 32, 1, False), (256, 64, 4, 64, 2, True), (256, 64, 8, 128, 1, True),
    (96, 32, 5, 32, 3, False), (96, 32, 6, 32, 1, False),  # 5/6 bits: a last chunk of 32
    (256, 64, 6, 64, 2, True), (448, 64, 7, 64, 1, False),  # act-order high planes; 7 bits as bytes
])
def test_quantized_layer_matches_float64(k, n, bits, group, rows, act_order):
    lin, w = layer(k, n, bits, group, act_order)
    fast = lcpu.CpuQuantLinear.from_gptq(lin)
    assert fast is not None and fast.store_bits == (4 if bits <= 4 else bits if bits <= 6 else 8)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    perm = fast.perm if fast.perm.numel() else torch.arange(k)
    xr = torch.empty_like(x, dtype=torch.float64)
    xr[:, perm] = round_like_kernel(x[:, perm])  # the kernel rounds x in the order it reads it
    ref = xr @ w.t()
    y = fast(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # prefill rows (float32: the layer dequantized exactly for torch's matmul)
    xs = torch.randn(kcpu.MAX_ROWS + 3, k, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(fast(xs).double(), xs.double() @ w.t(), rtol=0.05, atol=0.03 * (xs.abs().max() * w.abs().sum(1).max()).item())


@pytest.mark.parametrize("k,n,bits,group,act_order", [
    (576, 80, 4, 128, False), (96, 40, 4, 32, False), (256, 64, 8, 64, False), (256, 64, 4, 64, True),
    (160, 32, 5, 32, False),  # 5 bits: a row at a time
])
def test_a_bf16_prefill_gives_each_row_its_decode_result(k, n, bits, group, act_order):
    """Many bf16 rows (a prefill) through the kernel where prefill_product takes it (4 rows a weight
    load at 4 and 8 bits): each row's output is bit for bit the one it gets alone (a decode step), and the
    product is the float64 one of x rounded as the kernel rounds it."""
    lin, w = layer(k, n, bits, group, act_order)
    fast = lcpu.CpuQuantLinear.from_gptq(lin)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(3)).bfloat16()  # 3 x 4 rows + 1
    y = fast(x)
    perm = fast.perm if fast.perm.numel() else torch.arange(k)
    xr = torch.empty(x.shape, dtype=torch.float64)
    xr[:, perm] = round_like_kernel(x.float()[:, perm])
    ref = xr @ w.t()
    if lcpu.prefill_product() == "llamactl":
        assert torch.equal(y, torch.cat([fast(x[i : i + 1]) for i in range(13)]))
        torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())  # y in bf16
        assert fast.product(13) == "low-bit llamactl cpu" + (" (4 rows a load)" if bits in (4, 8) else "")
    else:
        assert fast.product(13) == "low-bit dequantize + oneDNN"


@pytest.mark.parametrize("scales_dtype,bits", [(torch.float16, 4), (torch.float32, 4), (torch.float16, 5),
                                               (torch.float16, 6)])
def test_dequant_op_is_the_layer_weight(scales_dtype, bits):
    n = 40 if bits == 4 else 64  # 40: a last tile of 8 rows (GPTQ packs 5/6-bit zeros in 32s)
    lin, w = layer(576, n, bits, 128)
    if scales_dtype == torch.float32:  # scales fp16 cannot hold exactly stay float32
        lin.scales = lin.scales.float() * (1 + 2**-14)
        w = lin.dequantized(torch.float64)
    fast = lcpu.CpuQuantLinear.from_gptq(lin)
    assert fast.scales.dtype == scales_dtype and fast.scales.shape == (-(-n // 16), 5, 16)
    d = torch.ops.llamactl_cpu.dequant(fast.weight_packed, fast.scales, fast.zeros, fast.blk2grp, bits, n, 576)
    assert d.dtype == torch.bfloat16 and d.shape == (n, 576)
    torch.testing.assert_close(d.double(), w, rtol=1e-2, atol=1e-2 * w.abs().max().item())
    torch.testing.assert_close(fast.dequantized(torch.float64), w)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(4))
    ref = round_like_kernel(x) @ w.t()
    torch.testing.assert_close(fast(x).double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("bits,k", [(4, 96), (4, 128), (8, 96), (5, 96), (6, 160)])
def test_tiles_round_trip(bits, k):
    codes = torch.randint(0, 2**bits, (21, k))  # 21 rows: a padded second tile
    packed = lcpu.pack_tiles(codes, bits)
    assert packed.shape == (2, k * bits // 8 * 16) and packed.dtype == torch.uint8
    assert torch.equal(lcpu.unpack_tiles(packed, 21, k, bits).long(), codes)
    if bits in (4, 5, 6):  # unit 0 of the first chunk: row r's bytes 4r .. 4r + 3 hold inputs 0-3 | 32-35 << 4
        assert int(packed[0, 4 * 3 + 1]) == int(codes[3, 1]) & 15 | (int(codes[3, 33]) & 15) << 4
    if bits in (5, 6):  # after the nibbles, unit 0's planes: bit 4 r + j of the low nibble's first is input j's bit 4
        plane = int.from_bytes(bytes(packed[0, k * 8 : k * 8 + 8].tolist()), "little")
        assert (plane >> (4 * 3 + 1)) & 1 == (int(codes[3, 1]) >> 4) & 1
    if bits == 8:  # unit 1: inputs 4-7
        assert int(packed[1, 64 + 4 * 2 + 3]) == int(codes[18, 7])
    v = torch.randn(21, 3)
    assert lcpu.tile_rows(v).shape == (2, 3, 16) and torch.equal(lcpu.untile_rows(lcpu.tile_rows(v), 21), v)


def test_groups_that_split_a_block_are_left_to_torch():
    assert lcpu.block_groups(torch.arange(64) // 16) == (None, None)  # groups of 16
    assert lcpu.block_groups(torch.arange(40) // 40) == (None, None)  # not whole blocks of 32


@pytest.mark.parametrize("k,rows", [(384, 1), (100, 3), (64, 8)])
def test_bf16_layer_matches_float64(k, rows):
    g = torch.Generator().manual_seed(3)
    lin = lcpu.CpuLinear(k, 72, bias=True, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(72, k, generator=g))
        lin.bias.copy_(torch.randn(72, generator=g))
    x = torch.randn(rows, k, generator=g).bfloat16()
    ref = x.double() @ lin.weight.double().t() + lin.bias.double()
    y = lin(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_quantized_layers_concatenate():
    a, wa = layer(256, 32, 4, 64, seed=1)
    b, wb = layer(256, 48, 4, 64, seed=2)
    fused = lcpu.CpuQuantLinear.concat([lcpu.CpuQuantLinear.from_gptq(a), lcpu.CpuQuantLinear.from_gptq(b)])
    x = torch.randn(1, 256)
    ref = round_like_kernel(x) @ torch.cat([wa, wb]).t()
    torch.testing.assert_close(fused(x).double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    c, _ = layer(256, 32, 8, 64)
    assert lcpu.CpuQuantLinear.concat([lcpu.CpuQuantLinear.from_gptq(a), lcpu.CpuQuantLinear.from_gptq(c)]) is None


def attention_reference(q, k, v, pos):
    """Row b of q [B, H_kv, R, D] against cache positions 0..pos[b] of k/v, in float64."""
    out = []
    for b in range(q.shape[0]):
        n = int(pos[b if pos.numel() > 1 else 0]) + 1
        s = q[b].double() @ k[b, :, :n].double().transpose(-1, -2) * q.shape[-1] ** -0.5  # [H_kv, R, n]
        out.append(torch.softmax(s, -1) @ v[b, :, :n].double())
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,h,r,d,s,pos", [(1, 3, 3, 64, 192, [150]), (3, 2, 4, 64, 600, [0, 300, 599]),
                                           (2, 6, 1, 128, 64, [10, 63]), (1, 1, 8, 80, 1000, [999]),
                                           (1, 2, 2, 256, 300, [299])])
def test_decode_attention_matches_float64(dtype, b, h, r, d, s, pos):
    """GQA groups of 1-8 query heads, each row at its own position (one for all rows with [1]),
    caches longer than one chunk of 256 (chunks combined), a head width of 80, a cache with more
    rows than the batch; positions past a row's own are never read (they hold NaN here)."""
    g = torch.Generator().manual_seed(b * 100 + s)
    q = torch.randn(b, h, r, d, generator=g).to(dtype)
    k, v = (torch.randn(b + 1, h, s, d, generator=g).to(dtype) for _ in range(2))
    p = torch.tensor(pos)
    for t, n in zip(k, [*pos, -1] if len(pos) > 1 else [pos[0]] * (b + 1)):  # unused positions: NaN
        t[:, n + 1 :] = float("nan")
    for t, n in zip(v, [*pos, -1] if len(pos) > 1 else [pos[0]] * (b + 1)):
        t[:, n + 1 :] = float("nan")
    got = torch.ops.llamactl_cpu.decode_attention(q, k, v, p, d**-0.5)
    ref = attention_reference(q, k, v, p)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,h,r,d,s,pos", [(3, 2, 4, 64, 600, [0, 300, 599]), (1, 2, 2, 128, 300, [299]),
                                           (1, 1, 2, 72, 100, [99])])
def test_decode_attention_reads_an_8bit_cache_with_its_scales(name, dtype, b, h, r, d, s, pos):
    """An 8-bit cache (runtime.kv_format): int8 or e4m3 K/V (its small values subnormal) and a
    float16 scale per position and head, against float64 attention over the dequantized cache
    (the vector path, and the plain loop at a head width of 72); scales past a row's position (NaN
    here) are never read."""
    from llamactl.runtime.kv_format import dequantize, quantize, resolve

    g = torch.Generator().manual_seed(b * 100 + s)
    q = torch.randn(b, h, r, d, generator=g).to(dtype)
    (k, ks), (v, vs) = (quantize(torch.randn(b + 1, h, s, d, generator=g) * 3, resolve(name, dtype)) for _ in range(2))
    if name == "fp8":
        assert ((k.view(torch.uint8) & 0x78) == 0).any()  # e4m3 subnormals among the values read
    p = torch.tensor(pos)
    ref = attention_reference(q, dequantize(k, ks, torch.float64), dequantize(v, vs, torch.float64), p)
    for sc in (ks, vs):
        for row, n in enumerate([*pos, -1]):
            sc[row, :, n + 1 :] = float("nan")
    got = torch.ops.llamactl_cpu.decode_attention(q, k, v, p, d**-0.5, ks, vs)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    with pytest.raises(RuntimeError, match="scales with an 8-bit cache alone"):
        torch.ops.llamactl_cpu.decode_attention(q, k, v, p, d**-0.5)


@pytest.mark.parametrize("d", [64, 72])
def test_e4m3_subnormal_values_are_read_as_theirs(d):
    """Values of an fp8 cache in e4m3's subnormal range (exponent 0: the mantissa times 2^-9) and
    its smallest normals, read by the vector path (D = 64) and the plain loop (D = 72: not whole
    vectors)."""
    g = torch.Generator().manual_seed(d)
    q = torch.randn(1, 2, 2, d, generator=g)
    codes = lambda: (torch.randint(0, 16, (2, 2, 50, d), generator=g, dtype=torch.uint8)  # noqa: E731
                     | (torch.randint(0, 2, (2, 2, 50, d), generator=g, dtype=torch.uint8) << 7))
    k, v = (codes().view(torch.float8_e4m3fn) for _ in range(2))
    assert ((v.view(torch.uint8) & 0x78) == 0).float().mean() > 0.4  # about half subnormal
    ones = torch.ones(2, 2, 50, dtype=torch.float16)
    p = torch.tensor([49])
    got = torch.ops.llamactl_cpu.decode_attention(q, k, v, p, d**-0.5, ones, ones)
    ref = attention_reference(q, k.double(), v.double(), p)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_quantize_gives_the_cache_writes_numbers(name, dtype):
    """The CPU kernels' one-pass quantization equals kv_format's PyTorch path bit for bit (scales
    and values; rows from 1e-6 to 1e3 in magnitude, an all-zero row), and the cache's writes use it
    once the kernels are loaded."""
    from llamactl.runtime import kv_format

    fmt = kv_format.resolve(name, torch.float32)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 4, 40, 64, generator=g) * torch.logspace(-6, 3, 40)[None, None, :, None]).to(dtype)
    x[0, 0, 0] = 0
    got = torch.ops.llamactl_cpu.kv_quantize(x, name == "int8")
    want = kv_format.quantize_reference(x, fmt)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert got[0].dtype == fmt.storage and got[1].dtype == kv_format.SCALE_DTYPE
    assert all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                           if b.dtype.itemsize == 1 else b) for a, b in zip(kv_format.quantize(x, fmt), got))


def test_decode_attention_refuses_a_position_outside_the_cache():
    q, k = torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 8, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.llamactl_cpu.decode_attention(q, k, k, torch.tensor([8]), 0.125)


def test_compiled_call():
    lin, w = layer(256, 64, 4, 128)
    fast = lcpu.CpuQuantLinear.from_gptq(lin)
    x = torch.randn(1, 256)
    f = torch.compile(lambda t: fast(t) * 2, fullgraph=True)
    torch.testing.assert_close(f(x), fast(x) * 2)


def test_no_compiler_is_one_line(monkeypatch):
    monkeypatch.setattr(kcpu, "_compiler", lambda: None)
    kcpu.load.cache_clear()
    try:
        problem = kcpu.load()
    finally:
        monkeypatch.undo()
        kcpu.load.cache_clear()
    assert problem is not None and "C++ compiler" in problem and "\n" not in problem
    assert kcpu.load() is None  # built already: found in the cache


@pytest.mark.parametrize("heads,kv_heads,want", [(4, 1, "llamactl cpu"), (32, 1, "sdpa")])
def test_decode_attention_is_planned_where_it_fits(tmp_path, heads, kv_heads, want):
    """A model whose KV heads serve more query heads than the kernel takes (32 to 1) keeps SDPA;
    either way greedy decoding gives the tokens of torch's own path (float32)."""
    from conftest import make_hf_model
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.step import Decoder
    from llamactl.layers.plan import prepare
    from llamactl.runtime.load import load_model
    from llamactl.options import RuntimeOptions

    folder = make_hf_model(tmp_path / "m", heads=heads, kv_heads=kv_heads, hidden=256, layers=2, seed=4)
    runs = {}
    for kernels in (True, False):
        options = RuntimeOptions(kernels=kernels)
        model = load_model(open_artifact(folder), torch.device("cpu"), torch.float32, options)
        plan = prepare(model, options)
        dec = Decoder(model, 1, 48, options=options)
        ids = torch.arange(3, 20).view(1, -1)
        with torch.inference_mode():
            toks = [dec.prefill(ids)]
            for i in range(8):
                toks.append(dec.step(toks[-1], ids.shape[1] + i))
        runs[kernels] = ([int(t) for t in toks], plan.attention)
    vector = lcpu.quant_fast() or lcpu.bf16_fast()  # the CPU layers (and this attention) run at all here
    assert runs[True][1] == (want if vector else "sdpa") and runs[False][1] == "sdpa"
    assert runs[True][0] == runs[False][0]


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_decode_step_over_an_8bit_cache_runs_the_cpu_attention_on_the_8bit_values(tiny_gqa, monkeypatch, name):
    """The model's CPU decode path with an 8-bit cache hands the kernel the cache's 8-bit rows and
    scales (no dequantized copy), and gives the logits SDPA gives over the dequantized cache."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.runtime.kv_cache import StaticCache
    from llamactl.runtime.kv_format import resolve
    from llamactl.runtime.load import load_model

    from test_attention_kernels import rows_step

    model = load_model(open_artifact(tiny_gqa), torch.device("cpu"), torch.float32)
    fmt = resolve(name, torch.float32)
    rows = rows_step(model, fmt, "cpu")

    def step(kernel: str):
        for layer in model.model.layers:
            layer.self_attn.decode_kernel = kernel
        return rows()

    seen = []
    op = torch.ops.llamactl_cpu.decode_attention.default
    with torch.inference_mode():
        ref = step("")
        monkeypatch.setattr(torch.ops.llamactl_cpu.decode_attention, "default",
                            lambda q, k, v, *a: seen.append(k.dtype) or op(q, k, v, *a))
        got = step("cpu")
    assert seen == [fmt.storage] * len(model.model.layers)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
