"""FP8 (e4m3) in Triton: rounding to e4m3's grid, and a multi-row step's activations quantized per
row (token) in one kernel for torch._scaled_mm (layers.fp8).

PyTorch quantizes a row in six kernels (abs, amax, the float copy, the division, the clamp, the
cast), each a pass over the activations: at a 2,048-token prefill of a 4,096-wide model about
150 MB a linear. Here one program a row reads it twice (its largest magnitude, then the codes)
and writes the codes and the row's scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
TINY = float(torch.finfo(torch.float32).tiny)  # the smallest scale (an all-zero row)
BLOCK = 1024  # columns a pass of a row takes at a time


@triton.jit
def round_half_even(y):
    """y (float32) rounded to the nearest integer, ties to even (torch.round's rule)."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + ((d > 0.5) | ((d == 0.5) & odd)).to(tl.float32)


@triton.jit
def e4m3_round(y):
    """y (float32, |y| <= 448) rounded to e4m3's grid (3 mantissa bits; a step of 2^-9 below
    2^-6), ties to even as PyTorch's conversion, so the conversion to fp8 is exact whatever its
    own rounding (Triton's interpreter's is not to nearest)."""
    step = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(y), 2.0**-6))) - 3.0)
    return round_half_even(y / step) * step


@triton.jit
def _row_values(x_ptr, w_ptr, row, x_row, k, ok, rstd, K, NORM: tl.constexpr, GLU: tl.constexpr):
    """Columns k of row `row` as the linear reads them, in float32 (PyTorch's unfused steps round
    each to x's dtype; here nothing is rounded before the quantization): x; with NORM,
    x * rstd * w (RMSNorm, w [K]); with GLU, silu(g) * u of the row's [g; u] (2K wide)."""
    x = tl.load(x_ptr + row * x_row + k, mask=ok, other=0.0).to(tl.float32)
    if GLU:
        u = tl.load(x_ptr + row * x_row + K + k, mask=ok, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * u
    if NORM:
        x = x * rstd * tl.load(w_ptr + k, mask=ok, other=0.0).to(tl.float32)
    return x


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, w_ptr, K, x_row, eps, QMAX: tl.constexpr, TINY_: tl.constexpr,
                       BLOCK_: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr):
    # x: [M, K] ([M, 2K] with GLU; x_row elements from one row to the next), q: [M, K] float8_e4m3fn,
    # s: [M] float32, w: [K] the RMSNorm's weight (NORM); one program a row: v = the row as read
    # (_row_values), q = v / s rounded, s = max|v| / QMAX
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_)
    rstd = 1.0
    if NORM:  # the row's root mean square first (one more pass)
        sq = tl.zeros([BLOCK_], tl.float32)
        for k0 in range(0, K, BLOCK_):
            k = k0 + cols
            x = tl.load(x_ptr + row * x_row + k, mask=k < K, other=0.0).to(tl.float32)
            sq += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)
    amax = tl.zeros([BLOCK_], tl.float32)
    for k0 in range(0, K, BLOCK_):
        k = k0 + cols
        amax = tl.maximum(amax, tl.abs(_row_values(x_ptr, w_ptr, row, x_row, k, k < K, rstd, K, NORM, GLU)))
    scale = tl.maximum(tl.max(amax, axis=0) / QMAX, TINY_)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_):
        k = k0 + cols
        x = _row_values(x_ptr, w_ptr, row, x_row, k, k < K, rstd, K, NORM, GLU)
        y = e4m3_round(tl.minimum(tl.maximum(x / scale, -QMAX), QMAX))
        tl.store(q_ptr + row * K + k, y.to(q_ptr.dtype.element_ty), mask=k < K)


def quantize_rows(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (float8_e4m3fn [M, K], float32 scales [M, 1]): x ~ q * scale
    per row, as layers.fp8.quantize_rows does in PyTorch. With norm_weight [K], the row's RMSNorm
    (eps) is quantized; with glu, x is [M, 2K], a fused [gate; up] output, and silu(gate) * up is:
    the step before the linear folded into its activations' quantization (one pass less over them)."""
    m, k = x.shape
    k = k // 2 if glu else k
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quant_rows_kernel[(m,)](x, q, s, x if norm_weight is None else norm_weight, k, x.stride(0), eps,
                                 QMAX=E4M3_MAX, TINY_=TINY, BLOCK_=BLOCK, NORM=norm_weight is not None, GLU=glu,
                                 num_warps=4)
    return q, s
