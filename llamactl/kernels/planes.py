"""Matrix-vector (and few-row) products with 3-, 5- and 6-bit weights read packed.

A b-bit code is stored as two bit planes whose widths divide 32 (the split of GPTQModel's planar
format, layers.planes.SPLITS): 3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2 bits. Each plane is laid out per
output row, codes along the input packed low bits first ([N, K * width / 32] int32), so a program streams
its rows' words once and rebuilds each code as low | high << LO in registers; per group of G
inputs an fp16 scale and a uint8 zero point ([N, groups]): w = (code - zero) * scale.

One program takes BLOCK_N outputs for every row of x and streams their words once, without
repeats: per block of inputs a tile of low-plane words, the high-plane word of each and the
group's scale and zero; code j of every word then multiplies inputs j, j + PER, ... (as the int4
kernels do). One row sums in float32; 2 to MAX_ROWS rows multiply on the tensor cores (tl.dot,
rows padded to 16). More rows are a prefill: the layer dequantizes for cuBLAS (layers.planes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels.device import interpreted

MAX_ROWS = 64


@triton.jit
def _planes_kernel(x_ptr, lo_ptr, hi_ptr, s_ptr, z_ptr, y_ptr, N, K, ROWS, G: tl.constexpr, LO: tl.constexpr,
                   HI: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   F32: tl.constexpr):
    # a block of BLOCK_K inputs is WORDS low-plane words a row; code j of word w is input k0 + w * PER + j
    PER: tl.constexpr = 32 // LO
    WORDS: tl.constexpr = BLOCK_K // PER
    HI_PER: tl.constexpr = 32 // HI
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] this program's outputs
    n_ok = n < N
    r = tl.arange(0, BLOCK_M)  # [BM] rows of x
    r_ok = r < ROWS
    rows = n.to(tl.int64)[:, None]  # [BN, 1]
    groups = tl.cdiv(K, G)
    dt: tl.constexpr = tl.float32 if F32 else x_ptr.dtype.element_ty  # F32: the interpreter's dots
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)  # one row: products summed across K at the end
    for k0 in range(0, K, BLOCK_K):
        w_idx = k0 // PER + tl.arange(0, WORDS)  # [W] low-plane words of this block
        ok = n_ok[:, None] & (w_idx < K // PER)[None, :]  # [BN, W]
        lo = tl.load(lo_ptr + rows * (K // PER) + w_idx[None, :], mask=ok, other=0)  # [BN, W]
        first = w_idx * PER  # [W] the input of each word's first code
        hi = tl.load(hi_ptr + rows * (K // HI_PER) + (first // HI_PER)[None, :], mask=ok, other=0)  # [BN, W]
        g = (first // G)[None, :]  # [1, W] (PER divides G: a word's codes share a group)
        s = tl.load(s_ptr + rows * groups + g, mask=ok, other=0.0).to(tl.float32)  # [BN, W]
        z = tl.load(z_ptr + rows * groups + g, mask=ok, other=0).to(tl.float32)
        for j in tl.static_range(PER):
            k = first + j  # [W]
            q = ((lo >> (j * LO)) & ((1 << LO) - 1)) | (((hi >> ((k % HI_PER) * HI)[None, :]) & ((1 << HI) - 1)) << LO)
            w = (q.to(tl.float32) - z) * s  # [BN, W] the weights of inputs k
            x = tl.load(x_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None] & (k < K)[None, :], other=0.0)  # [BM, W]
            if BLOCK_M == 1:
                part += w * x.to(tl.float32)  # [BN, W]
            else:
                acc += tl.dot(x.to(dt), tl.trans(w.to(dt)), input_precision="ieee" if F32 else "tf32")  # [BM, BN]
    if BLOCK_M == 1:
        acc = tl.sum(part, axis=1)[None, :]  # [1, BN]
    tl.store(y_ptr + r[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


def gemv_planes(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                lo_w: int, hi_w: int, group: int) -> torch.Tensor:
    """x: [R, K] (R <= MAX_ROWS) -> [R, N] in x's dtype, the weights read once for all rows; lo_w,
    hi_w: the planes' widths."""
    rows, k = x.shape
    n = lo.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))
    # 1 row: 16 outputs x 512 inputs a step; more: words enough for tl.dot's 16-deep K
    block_n, block_k = (16, 512) if rows == 1 else (32, 16 * (32 // lo_w))
    _planes_kernel[(triton.cdiv(n, block_n),)](x.contiguous(), lo, hi, scales, zeros, y, n, k, rows, G=group, LO=lo_w,
                                               HI=hi_w, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                               F32=interpreted() or x.dtype == torch.float32, num_warps=4)
    return y
