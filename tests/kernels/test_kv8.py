"""The 8-bit KV cache (runtime.kv_format): quantization, the attention kernels reading int8 and fp8
caches with their scales, the decode kernel writing them, and a model decoding over one. Without
CUDA the kernels run through Triton's interpreter (set in conftest)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from llamactl.errors import InputError  # noqa: E402
from llamactl.kernels import attention  # noqa: E402
from llamactl.runtime.kv_cache import PagedCache, StaticCache  # noqa: E402
from llamactl.runtime.kv_format import SCALE_DTYPE, dequantize, quantize, resolve  # noqa: E402
from test_attention_kernels import rows_step  # noqa: E402
from test_kernels import ATTN_DTYPE, DEV, rel  # noqa: E402

EIGHT = ["int8", "fp8"]


def _softmax_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [.., R, D], k/v [.., S, D] -> float64 attention [.., R, D]."""
    s = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
    return s.softmax(-1) @ v.double()


@pytest.mark.parametrize("name", EIGHT)
def test_quantize_keeps_each_value_within_its_step(name):
    fmt = resolve(name, torch.float32)
    torch.manual_seed(0)
    x = torch.randn(4, 3, 50, 64) * torch.rand(4, 3, 50, 1) * 10  # vectors of different magnitudes
    x[0, 0, 0] = 0  # an all-zero vector: no division by zero
    q, s = quantize(x, fmt)
    assert q.dtype == fmt.storage and s.dtype == SCALE_DTYPE and s.shape == x.shape[:-1]
    back = dequantize(q, s, torch.float32)
    assert torch.equal(back[0, 0, 0], torch.zeros(64))
    err = (back - x).abs() / x.abs().amax(-1, keepdim=True).clamp(min=1e-9)  # relative to each vector's max
    assert err.max() < (0.5 / 127 + 1e-3 if name == "int8" else 1 / 16)  # half an int8 step; e4m3's 3-bit mantissa
    assert rel(back, x.double()) < (0.01 if name == "int8" else 0.04)


def test_the_format_follows_the_option_and_refuses_a_mismatched_16_bit_cache():
    assert resolve("auto", torch.bfloat16).storage == torch.bfloat16
    assert resolve("bf16", torch.bfloat16).quantized is False
    assert resolve("int8", torch.bfloat16).storage == torch.int8
    assert resolve("int8", torch.float16).bytes_per_head(128) == 130  # 128 values and a float16 scale
    with pytest.raises(InputError, match="--kv-dtype fp16 with a bfloat16 model"):
        resolve("fp16", torch.bfloat16)
    with pytest.raises(InputError, match="not a KV cache format"):
        resolve("int4", torch.bfloat16)


def test_an_8bit_pool_holds_nearly_twice_the_tokens_in_the_same_bytes():
    class Args:
        num_hidden_layers, num_key_value_heads, head_dim = 32, 8, 128  # llama3-8b

    class Model:
        args, dtype = Args, torch.bfloat16

    per16 = PagedCache.block_bytes(Model, 16)
    per8 = PagedCache.block_bytes(Model, 16, resolve("int8", torch.bfloat16))
    assert per16 / per8 == pytest.approx(256 / 130)  # 1.97x
    cache = PagedCache(2, 2, 10, 16, 64, 8, 128, torch.bfloat16, "cpu", resolve("fp8", torch.bfloat16))
    assert cache.nbytes == 2 * 2 * 10 * 16 * 8 * 130  # layers, K and V, blocks, positions, heads, bytes


@pytest.mark.parametrize("name", EIGHT)
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
@pytest.mark.parametrize("dtype", [ATTN_DTYPE, torch.float32], ids=["16-bit", "float32"])
def test_decode_attention_reads_an_8bit_cache_as_its_dequantized_values(name, paged, dtype):
    fmt = resolve(name, dtype)
    torch.manual_seed(1)
    b, kv, rep, d, s = 3, 2, 4, 64, 256
    q = torch.randn(b, kv, rep, d, device=DEV, dtype=dtype)
    k, v = (torch.randn(b, kv, s, d, device=DEV) * 3 for _ in range(2))
    pos = torch.tensor([0, 77, s - 1], device=DEV)
    if paged:  # each row's blocks shuffled over the pool
        cache = PagedCache(1, b, 3 * 16 + 1, 16, s, kv, d, dtype, DEV, fmt)
        cache.set_rows(list(range(b)), (torch.randperm(3 * 16) + 1).view(b, 16).tolist())
        layer = cache.layers[0]
        layer.write(torch.arange(s, device=DEV), k, v)
        out = attention.paged_decode_attention(q, layer.k, layer.v, cache.table, pos, 64, False, layer.k_scale,
                                               layer.v_scale)
        read = [layer_update_read(cache, i, s - 1) for i in range(b)]
        dk, dv = (torch.cat([x[j].transpose(1, 2) for x in read]) for j in (0, 1))  # [B, H_kv, S, D]
    else:
        (qk, sk), (qv, sv) = quantize(k, fmt), quantize(v, fmt)
        out = attention.decode_attention(q, qk, qv, pos, 64, False, sk, sv)
        dk, dv = dequantize(qk, sk, torch.float64), dequantize(qv, sv, torch.float64)
    assert rel(dk, k.double()) < 0.04  # what the kernel reads is the keys, 8-bit
    for i, p in enumerate(pos.tolist()):
        assert rel(out[i].cpu(), _softmax_ref(q[i], dk[i, :, : p + 1], dv[i, :, : p + 1]).cpu()) < 5e-3, p


@pytest.mark.parametrize("name", EIGHT)
def test_a_query_too_large_for_float16_dots_is_read_scaled(name):
    """An 8-bit cache is read in float16 dots: a query whose largest value is past what they hold
    (past 16,384: here 3e4 in float16, 1e6 in bfloat16) is divided by a power of two first and
    its scores multiplied back."""
    fmt = resolve(name, ATTN_DTYPE)
    torch.manual_seed(5)
    b, kv, rep, d, s = 2, 2, 2, 64, 200
    top = 3e4 if ATTN_DTYPE == torch.float16 else 1e6
    q = (torch.randn(b, kv, rep, d, device=DEV) * top / 3).clamp(-top, top).to(ATTN_DTYPE)
    k, v = (torch.randn(b, kv, s, d, device=DEV) * 1e-3 for _ in range(2))
    (qk, sk), (qv, sv) = quantize(k, fmt), quantize(v, fmt)
    pos = torch.tensor([130, s - 1], device=DEV)
    out = attention.decode_attention(q, qk, qv, pos, 64, False, sk, sv)
    dk, dv = dequantize(qk, sk, torch.float64), dequantize(qv, sv, torch.float64)
    assert torch.isfinite(out).all()
    for i, p in enumerate(pos.tolist()):
        assert rel(out[i].cpu(), _softmax_ref(q[i], dk[i, :, : p + 1], dv[i, :, : p + 1]).cpu()) < 5e-3, p


@pytest.mark.parametrize("name", EIGHT)
@pytest.mark.parametrize("paged", [False, True], ids=["static", "paged"])
def test_the_decode_kernel_quantizes_what_it_writes_as_the_cache_does(name, paged):
    """RoPE and the cache write folded into the decode kernel: the new key (rotated) and value go
    in as kv_format.quantize puts them (int8 within one step: the kernel rounds halves up), nothing
    else changes, and the attention reads them back."""
    from llamactl.runtime.model import apply_rope

    fmt = resolve(name, ATTN_DTYPE)
    torch.manual_seed(2)
    b, kv, rep, d, s, bs = 2, 2, 2, 64, 128, 16
    pos = torch.tensor([40, 95], device=DEV)
    if paged:
        cache = PagedCache(1, b, 20, bs, s, kv, d, ATTN_DTYPE, DEV, fmt)
        cache.set_rows([0, 1], [list(range(1, 9)), list(range(12, 20))])
    else:
        cache = StaticCache(1, b, kv, s, d, ATTN_DTYPE, DEV, fmt)
    layer = cache.layers[0]
    old = torch.randn(b, kv, s, d, device=DEV, dtype=ATTN_DTYPE) * 2
    layer.write(torch.arange(s, device=DEV), old, old.flip(-1))  # every position filled, 8-bit
    before = [t.clone() for t in (layer.k, layer.v, layer.k_scale, layer.v_scale)]
    q, k_new, v_new = (torch.randn(b, kv, n, d, device=DEV, dtype=ATTN_DTYPE) for n in (rep, 1, 1))
    ang = torch.rand(b, d // 2, device=DEV) * 3
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # [B, D]
    if paged:
        out = attention.paged_decode_attention_rope(q, k_new[:, :, 0], v_new[:, :, 0], layer.k, layer.v, cache.table,
                                                    cos, sin, pos, 64, False, layer.k_scale, layer.v_scale)
    else:
        out = attention.decode_attention_rope(q, k_new[:, :, 0], v_new[:, :, 0], layer.k, layer.v, cos, sin, pos,
                                              64, False, layer.k_scale, layer.v_scale)
    for i, p in enumerate(pos.tolist()):
        c, s_ = cos[i].float()[None], sin[i].float()[None]
        kr = apply_rope(k_new[i].float(), c, s_)[:, 0]  # [KV, D]
        want_k, want_ks = quantize(kr, fmt)
        want_v, want_vs = quantize(v_new[i, :, 0].float(), fmt)
        if paged:
            at = (int(cache.table[i, p // bs]), p % bs)
        else:
            at = (i, slice(None), p)
        got = [layer.k[at], layer.v[at], layer.k_scale[at], layer.v_scale[at]]
        for t, u in zip(before, got):
            t[at] = u  # what the rest of the cache should still be, around the written position
        assert torch.allclose(got[2].float(), want_ks.float(), rtol=1e-3) and torch.allclose(got[3].float(),
                                                                                               want_vs.float(), rtol=1e-3)
        for g, w in ((got[0], want_k), (got[1], want_v)):
            step = 1 if name == "int8" else w.float().abs() / 8 + 2**-6  # e4m3: 3 mantissa bits (the interpreter
            assert ((g.float() - w.float()).abs() <= step).all()  # may round where the GPU rounds to nearest)
        # the attention over the cache as it is now (the new position included), dequantized
        if paged:
            keys, vals = (x.transpose(1, 2)[0] for x in layer_update_read(cache, i, p))
        else:
            keys = dequantize(layer.k[i, :, : p + 1], layer.k_scale[i, :, : p + 1], torch.float64)
            vals = dequantize(layer.v[i, :, : p + 1], layer.v_scale[i, :, : p + 1], torch.float64)
        qr = apply_rope(q[i].double(), cos[i].double()[None], sin[i].double()[None])
        assert rel(out[i].cpu(), _softmax_ref(qr, keys, vals).cpu()) < 5e-3
    assert all(torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t, u.view(torch.uint8)
                           if u.dtype.itemsize == 1 else u)
               for t, u in zip((layer.k, layer.v, layer.k_scale, layer.v_scale), before))  # nothing else written


def layer_update_read(cache: PagedCache, row: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `row`'s positions 0..p of a paged cache's first layer, dequantized: k, v [1, p + 1, H_kv, D]."""
    layer = cache.layers[0]
    pos = torch.arange(p + 1, device=cache.table.device)
    at = cache.at(torch.full_like(pos, row), pos)
    return tuple(dequantize(x.flatten(0, 1)[at], s.flatten(0, 1)[at], torch.float64)[None]
                 for x, s in ((layer.k, layer.k_scale), (layer.v, layer.v_scale)))


@pytest.mark.parametrize("name", EIGHT)
def test_packed_prefill_and_decode_rows_read_8bit_pools(name):
    """A mixed forward's attention (prompt chunks through the prefill kernel, decode rows through
    the paged decode kernel) over int8/fp8 pools equals the PyTorch reference, which dequantizes
    what it gathers."""
    from llamactl.runtime.ragged import Ragged, kernels, reference

    fmt = resolve(name, ATTN_DTYPE)
    torch.manual_seed(3)
    hkv, rep, d, bs, blocks = 2, 4, 64, 16, 48
    cache = PagedCache(1, 4, blocks, bs, 320, hkv, d, ATTN_DTYPE, DEV, fmt)
    order = (torch.randperm(blocks - 1)[:40] + 1).tolist()
    cache.set_rows([0, 1, 2, 3], [order[:10], order[10:20], order[20:30], order[30:40]])
    layer = cache.layers[0]
    x = torch.randn(blocks * bs, hkv, d, device=DEV) * 2
    layer.write_at(torch.arange(blocks * bs, device=DEV), x, -x)  # every pool position, 8-bit
    rows, starts, lens = [3, 1, 0, 2], [140, 7, 20, 0], [1, 1, 70, 5]
    r = Ragged.build(cache, rows, starts, lens, decode=2)
    q = torch.randn(sum(lens), hkv * rep, d, device=DEV, dtype=ATTN_DTYPE)
    got = kernels(q, layer.k, layer.v, cache.table, r, 64, layer.k_scale, layer.v_scale)
    want = reference(q.float(), layer.k, layer.v, cache.table, r, layer.k_scale, layer.v_scale)
    assert rel(got.double().cpu(), want.double().cpu()) < 5e-3


@pytest.mark.parametrize("name", EIGHT)
def test_a_decode_step_over_an_8bit_cache_runs_the_kernel_and_matches_sdpa(tiny_gqa, name):
    """A model's decode step of rows at their own positions over an 8-bit static cache: llamactl's
    kernel (RoPE, the quantized write and the attention folded in) gives the logits SDPA gives
    over the dequantized cache."""
    from llamactl.folder.artifact import open_artifact
    from llamactl.layers.plan import prepare
    from llamactl.options import RuntimeOptions
    from llamactl.runtime.load import load_model

    model = load_model(open_artifact(tiny_gqa), torch.device(DEV), torch.float32)
    step = rows_step(model, resolve(name, torch.float32))
    with torch.inference_mode():
        prepare(model, RuntimeOptions(kernels=False), interpreter=True)
        ref = step()
        prepare(model, RuntimeOptions(), interpreter=True)
        assert model.model.layers[0].self_attn.decode_kernel == "rope"
        got = step()
    assert rel(got.cpu(), ref.cpu()) < 1e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
