"""llamactl's 4-bit layout (kernels.gemv's docstring): packing codes, and dequantizing a layer to
16 bits on the device (prefill runs cuBLAS on it; tests compare against it), 5- and 6-bit codes
with their high plane too."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels.high_bits import column_high


@triton.jit
def _dequant_int4_kernel(q_ptr, h_ptr, s_ptr, z_ptr, w_ptr, words, G: tl.constexpr, BLOCK: tl.constexpr,
                         HI: tl.constexpr = 0):
    # q: [N, K // 8] int32 -> w: [N, K] in w's dtype, both read flat: one program per BLOCK
    # consecutive words and the 8 BLOCK weights they hold, one contiguous run of w (each thread
    # stores its words' 16-byte pieces)
    # HI = 1 or 2: 5- or 6-bit codes, q their low 4 bits, h: [N, K // 8] uint8 / int16 (given as
    # int32) the high ones, bits HI j .. of word i's entry for column 8 i + j (kernels.high_bits)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [B] flat word indices
    ok = i < words
    p = tl.load(q_ptr + i, mask=ok, other=0)  # [B]
    j = tl.arange(0, 8)
    codes = (p[:, None] >> (j * 4)[None, :]) & 0xF  # [B, 8]
    if HI > 0:
        h_ty: tl.constexpr = tl.uint8 if HI == 1 else tl.int16
        h = tl.load(h_ptr.to(tl.pointer_type(h_ty)) + i, mask=ok, other=0).to(tl.int32)  # [B]
        codes = codes | column_high(h[:, None], j[None, :], HI)
    g = i * 8 // G  # [B]: the word's group in s and z [N, K // G], read flat too (K % G == 0)
    s = tl.load(s_ptr + g, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g, mask=ok, other=0).to(tl.float32)
    w = (codes.to(tl.float32) - z[:, None]) * s[:, None]  # [B, 8]
    tl.store(w_ptr + i[:, None] * 8 + j[None, :], w.to(w_ptr.dtype.element_ty), mask=ok[:, None])


def _whole_groups(k: int, group_size: int) -> None:
    """The int4 kernels assume K % G == 0 (their 16-byte loads rely on it)."""
    if k % group_size:
        raise ValueError(f"int4 weight: {k} input columns are not whole groups of {group_size}")


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype, high: torch.Tensor | None = None, high_bits: int = 0, block: int = 512,
                    warps: int = 4) -> torch.Tensor:
    """The [N, K] weight in `dtype` (prefill runs cuBLAS on it; tests compare against it); high,
    high_bits: the high plane of 5- or 6-bit codes (kernels.gemv_int4.gemv_int4); block, warps:
    words a program and its warps (`git show 48f0ab6:scripts/int4_prefill_probe.py` swept them)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    _whole_groups(k, group_size)
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    words = n * (k // 8)
    _dequant_int4_kernel[(triton.cdiv(words, block),)](qweight, qweight if high is None else high, scales, zeros, w,
                                                       words, group_size, BLOCK=block, HI=high_bits,
                                                       num_warps=warps)
    return w


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [N, K] integers in 0..15 -> [N, K // 8] int32, nibble j of word i = column 8 i + j."""
    n, k = codes.shape
    c = codes.to(torch.int64).view(n, k // 8, 8)
    words = (c << (torch.arange(8, device=codes.device) * 4)).sum(dim=-1)  # [N, K // 8] in 0..2^32-1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
