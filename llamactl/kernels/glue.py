"""The steps between the products of a multi-row step, one Triton kernel each: RMSNorm and SwiGLU.

A batch-1 decode step folds them into its GEMVs; with more rows the products are cuBLAS's, and
PyTorch runs an RMSNorm as six kernels (the float copy, pow, mean, rsqrt, two multiplies) and a
SwiGLU as two: at 32 rows of llama2-7b they took more device time than the attention
(docs/bench/README.md). Here each is one kernel, one program a row, with PyTorch's rounding:
the norm in float32, rounded to the input's dtype, then multiplied by the weight and rounded
again (as HF's LlamaRMSNorm); silu(gate) rounded before the product with up (as F.silu(g) * u).
torch.compile traces the PyTorch ops instead (Inductor fuses them itself), see model.RMSNorm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, eps, BLOCK: tl.constexpr):
    # x, y: [rows, N], w: [N]; one program a row
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
def _silu_mul_kernel(h_ptr, y_ptr, N, BLOCK: tl.constexpr):
    # h: [rows, 2N] ([gate; up] a row), y: [rows, N]; program (row, block of N)
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    g = tl.load(h_ptr + row * 2 * N + i, mask=ok, other=0.0)
    u = tl.load(h_ptr + row * 2 * N + N + i, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(y_ptr + row * N + i, (silu.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] -> weight * (x / rms(x)) as HF's LlamaRMSNorm computes it, [..., N] in the dtype
    PyTorch's promotion of weight and x gives."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, n, eps, BLOCK=triton.next_power_of_2(n),
                                         num_warps=4 if n <= 4096 else 8)
    return y.view(x.shape)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """h: [..., 2 I], a fused [gate; up] output -> silu(gate) * up: [..., I]."""
    n = h.shape[-1] // 2
    h2 = h.reshape(-1, 2 * n).contiguous()
    y = torch.empty(h2.shape[0], n, dtype=h.dtype, device=h.device)
    block = min(1024, triton.next_power_of_2(n))
    if h2.shape[0]:
        _silu_mul_kernel[(h2.shape[0], triton.cdiv(n, block))](h2, y, n, BLOCK=block, num_warps=4)
    return y.view(*h.shape[:-1], n)
