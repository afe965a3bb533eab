"""The steps between the products of a multi-row step, one Triton kernel each: RMSNorm, SwiGLU,
and a prefill's RoPE.

A batch-1 decode step folds them into its GEMVs; with more rows the products are cuBLAS's, and
PyTorch runs an RMSNorm as six kernels (the float copy, pow, mean, rsqrt, two multiplies) and a
SwiGLU as two: at 32 rows of llama2-7b they took more device time than the attention
(docs/bench/README.md). Here each is one kernel, one program a row, with PyTorch's rounding:
the norm in float32, rounded to the input's dtype, then multiplied by the weight and rounded
again (as HF's LlamaRMSNorm); silu(gate) rounded before the product with up (as F.silu(g) * u).
RoPE: a prefill (or a multi-token step) rotated q and k with about fourteen kernels a layer (the
casts of cos and sin, rotate_half's negation and concatenation, two products and a sum, each for q
and for k); here one kernel each, with the same roundings (cos and sin rounded to x's dtype, each
product and the sum rounded; 16-bit only), writing [B, H, S, D] for attention.
Used from model.ROPE_KERNEL_TOKENS tokens a forward, where the device's time is what counts.
torch.compile traces the PyTorch ops instead (Inductor fuses them itself), see model.RMSNorm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels.device import pdl_launch
from llamactl.kernels.gdc import wait_for_previous


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # x, y: [rows, N], w: [N]; one program a row; PDL: a programmatic dependent launch (kernels.gdc)
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < N
    x = tl.load(x_ptr + row * N + i, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(w_ptr + i, mask=ok, other=0.0)
    tl.store(y_ptr + row * N + i, (w.to(tl.float32) * normed.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(h_ptr, y_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # h: [rows, 2N] ([gate; up] a row), y: [rows, N]; program (row, block of N); PDL: as _rms_norm_kernel's
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    g = tl.load(h_ptr + row * 2 * N + i, mask=ok, other=0.0)
    u = tl.load(h_ptr + row * 2 * N + N + i, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(y_ptr + row * N + i, (silu.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _round(x, dt: tl.constexpr, BF16: tl.constexpr):
    """float32 x rounded to dt (round to nearest even), as float32. bf16 by its bits: Triton's
    interpreter casts float32 to bf16 by truncation, a GPU to nearest; this is the GPU's on both
    (finite values)."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dt).to(tl.float32)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, S, H, sxb, sxs, sxh, scb, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_H: tl.constexpr, BF16: tl.constexpr):
    # x: [B, S, H, D] (strides sxb, sxs, sxh, 1), cos/sin: [B or 1, S, D] float32 (batch stride scb,
    # 0 where shared), y: [B, H, S, D] contiguous; program (b * S + s, block of heads)
    bs = tl.program_id(0).to(tl.int64)
    b, s = bs // S, bs % S
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h < H)[:, None] & (d < D)[None, :]
    dt = y_ptr.dtype.element_ty
    cos = _round(tl.load(cos_ptr + b * scb + s * D + d, mask=d < D, other=0.0), dt, BF16)  # cos.to(x.dtype)
    sin = _round(tl.load(sin_ptr + b * scb + s * D + d, mask=d < D, other=0.0), dt, BF16)
    row = x_ptr + b * sxb + s * sxs + h[:, None] * sxh
    x = tl.load(row + d[None, :], mask=ok, other=0.0).to(tl.float32)  # [BLOCK_H, D]
    partner = tl.load(row + ((d + D // 2) % D)[None, :], mask=ok, other=0.0).to(tl.float32)
    rot = tl.where((d < D // 2)[None, :], -partner, partner)  # rotate_half(x): (-x2, x1)
    y = _round(x * cos[None, :], dt, BF16) + _round(rot * sin[None, :], dt, BF16)
    tl.store(y_ptr + ((b * H + h[:, None]) * S + s) * D + d[None, :], _round(y, dt, BF16).to(dt), mask=ok)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D] (the last dimension contiguous; a view of a fused projection's output is
    fine), 16-bit, cos/sin: [S, D] or [B, S, D] float32 -> model.apply_rope(x.transpose(1, 2), cos,
    sin): [B, H, S, D] contiguous, the same bits."""
    b, s, h, d = x.shape
    if x.dtype not in (torch.bfloat16, torch.float16):  # float32: the compiler may fuse a product into the sum
        raise ValueError(f"rope: bfloat16 or float16, not {x.dtype} (float32 takes model.apply_rope)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    y = torch.empty(b, h, s, d, dtype=x.dtype, device=x.device)
    block_h = min(16, triton.next_power_of_2(h))
    if b * s:
        _rope_kernel[(b * s, triton.cdiv(h, block_h))](x, cos, sin, y, s, h, x.stride(0), x.stride(1), x.stride(2),
                                                       s * d if cos.dim() == 3 else 0, D=d, BLOCK_D=triton.next_power_of_2(d),
                                                       BLOCK_H=block_h, BF16=x.dtype == torch.bfloat16,
                                                       num_warps=4)
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """x: [..., N] -> weight * (x / rms(x)) as HF's LlamaRMSNorm computes it, [..., N] in the dtype
    PyTorch's promotion of weight and x gives; pdl: a programmatic dependent launch."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, n, eps, BLOCK=triton.next_power_of_2(n),
                                         num_warps=4 if n <= 4096 else 8, **pdl_launch(pdl))
    return y.view(x.shape)


def silu_mul(h: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """h: [..., 2 I], a fused [gate; up] output -> silu(gate) * up: [..., I]; pdl: a programmatic
    dependent launch."""
    n = h.shape[-1] // 2
    h2 = h.reshape(-1, 2 * n).contiguous()
    y = torch.empty(h2.shape[0], n, dtype=h.dtype, device=h.device)
    block = min(1024, triton.next_power_of_2(n))
    if h2.shape[0]:
        _silu_mul_kernel[(h2.shape[0], triton.cdiv(n, block))](h2, y, n, BLOCK=block, num_warps=4, **pdl_launch(pdl))
    return y.view(*h.shape[:-1], n)
