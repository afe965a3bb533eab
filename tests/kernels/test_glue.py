"""The Triton RMSNorm and SwiGLU of multi-row steps (kernels/glue.py) against PyTorch's ops, with
PyTorch's roundings, and a model whose norms run them giving the tokens of one whose norms do not.
Without CUDA through Triton's interpreter (set in conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from llamactl.kernels import glue  # noqa: E402
from llamactl.runtime.model import RMSNorm  # noqa: E402
from llamactl.runtime.kv_cache import StaticCache
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


@pytest.mark.parametrize("dtype,d,rows", [(torch.bfloat16, 128, False), (torch.float16, 64, True),
                                         (torch.float16, 80, False), (torch.bfloat16, 64, True)])
def test_rope_is_apply_rope_bit_for_bit(dtype, d, rows):
    """q as a view of a fused projection's output ([B, S, H, D] with the qkv row's stride), cos/sin
    shared or one per row, head widths that are not a power of two: the bits of model.apply_rope."""
    from llamactl.runtime.model import apply_rope

    torch.manual_seed(d)
    b, s, h = 2, 5, 3
    qkv = (torch.randn(b, s, 3 * h * d, device=DEV) * 3).to(dtype)
    q = qkv[..., : h * d].view(b, s, h, d)
    ang = torch.rand(b if rows else 1, s, d, device=DEV) * 50
    cos, sin = ang.cos(), ang.sin()
    if not rows:
        cos, sin = cos[0], sin[0]  # [S, D]
    want = apply_rope(q.transpose(1, 2), cos[:, None] if rows else cos, sin[:, None] if rows else sin)
    got = glue.rope(q, cos, sin)
    assert got.shape == (b, h, s, d) and got.is_contiguous()
    assert torch.equal(got, want)


@pytest.mark.parametrize("joined", [False, True])
@pytest.mark.slow
def test_a_prefill_with_the_rope_kernel_gives_the_same_logits(joined, monkeypatch):
    """A bf16 model's prefill with RoPE as the kernel (Attention.rope_kernel, here from the first
    token) against PyTorch's ops: one prompt, and two prompts joining in their cache rows at once
    (Decoder.prefill_slots' path: the cache written and not read back)."""
    from llamactl.runtime import model as model_mod
    from llamactl.runtime.synthetic import build_synthetic

    monkeypatch.setattr(model_mod, "ROPE_KERNEL_TOKENS", 1)
    model = build_synthetic("tiny", torch.device(DEV), torch.bfloat16)
    ids = torch.randint(1, 8000, (2 if joined else 1, 12), device=DEV)
    pos = torch.arange(12, device=DEV)
    slot = torch.tensor([3, 1], device=DEV) if joined else None
    outs, caches = [], []
    for on in (False, True):
        for layer in model.model.layers:
            layer.self_attn.rope_kernel = on
        cache = StaticCache.for_model(model, 4, 32)
        with torch.no_grad():
            outs.append(model(ids, pos, cache, slot=slot, kv_len=12))
        caches.append(cache.layers[1].k.clone())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1])
    if joined:  # each prompt's keys in its own cache row
        assert caches[1][3, :, :12].abs().sum() > 0 and caches[1][1, :, :12].abs().sum() > 0
        assert caches[1][0].abs().sum() == 0 and caches[1][2].abs().sum() == 0
