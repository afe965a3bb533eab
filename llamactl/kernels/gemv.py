"""Batch-1 matrix-vector products y = W x in Triton, for 16-bit, int8 and 4-bit weights.

A decode step at batch 1 reads every weight once per token, so its speed is the speed of these
products. cuBLAS reaches about 1.8 TB/s on a 4096x4096 bf16 matrix on an H200 (run2-int4_probe),
and PyTorch's int4 tinygemm kernel about 1.2 TB/s. These kernels give each program a few whole
rows (BLOCK_N) and stream them along K in BLOCK_K slices with 16-byte loads; many small programs
per multiprocessor keep enough loads in flight to approach memory bandwidth. Block sizes are tuned
per (N, K) shape on first use (triton.autotune), which happens in the warm-up before a CUDA graph
is captured.

4-bit layout (llamactl's own, built at load from GPTQ/RTN checkpoints):
  qweight [N, K // 8] int32   nibble j of word i is the code of input column 8 i + j
  scales  [N, K // G] fp16    zeros [N, K // G] uint8
  w[n, k] = (code - zero) * scale, with the group g = k // G.
Act-order checkpoints have their columns sorted by group at load and x gathered in that order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels import interpreted


def _bf16_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [(4, 512, 4, 1), (8, 256, 4, 1), (8, 512, 4, 1), (8, 512, 4, 2),
                                 (16, 256, 4, 1), (16, 512, 8, 1), (4, 1024, 4, 1), (8, 1024, 8, 1),
                                 (2, 1024, 4, 1), (16, 256, 8, 2), (32, 128, 4, 1), (4, 256, 2, 1)]]


def _prune_k(configs, named_args, **_):
    k = named_args["K"]
    kept = [c for c in configs if k % c.kwargs["BLOCK_K"] == 0]
    return kept or [c for c in configs if c.kwargs["BLOCK_K"] == min(x.kwargs["BLOCK_K"] for x in configs)]


@triton.jit
def _gemv_bf16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    # x: [K], w: [N, K] row-major (16-bit, or int8 with per-row scales s: [N]), y: [N]
    # one program per BLOCK_N rows
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    cols = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K  # [BN, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        w = tl.load(w_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # [BN]
    if HAS_SCALE:
        y = y * tl.load(s_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


_gemv_bf16_tuned = triton.autotune(configs=_bf16_configs(), key=["N", "K", "HAS_SCALE"],
                                   prune_configs_by={"early_config_prune": _prune_k})(_gemv_bf16_kernel)


def _int4_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=1)
            for bn, bk, w in [(8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 4), (4, 512, 4),
                              (4, 1024, 4), (8, 1024, 8), (16, 1024, 8), (32, 256, 4), (32, 512, 8),
                              (8, 128, 2), (16, 128, 4)]]


def _prune_int4(configs, named_args, **_):
    k, g = named_args["K"], named_args["G"]
    kept = [c for c in configs if k % c.kwargs["BLOCK_K"] == 0 and c.kwargs["BLOCK_K"] % g == 0]
    return kept or [triton.Config({"BLOCK_N": 8, "BLOCK_K": g}, num_warps=4, num_stages=1)]


@triton.jit
def _gemv_int4_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, K, G: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # x: [K], q: [N, K // 8] int32, s: [N, K // G] fp16, z: [N, K // G] uint8, y: [N]
    # K % BLOCK_K == 0 and BLOCK_K % G == 0 (the launcher picks such blocks)
    WORDS: tl.constexpr = BLOCK_K // 8
    GROUPS: tl.constexpr = BLOCK_K // G
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    words = tl.arange(0, WORDS)  # [W]
    shifts = tl.arange(0, 8) * 4  # [8]
    groups = tl.arange(0, GROUPS)  # [NG]
    acc = tl.zeros([BLOCK_N, GROUPS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        p = tl.load(q_ptr + rows64[:, None] * (K // 8) + (k0 // 8 + words)[None, :], mask=row_ok[:, None], other=0)
        codes = ((p[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32)  # [BN, W, 8], column 8w + j
        x = tl.load(x_ptr + k0 + words[:, None] * 8 + (shifts // 4)[None, :]).to(tl.float32)  # [W, 8]
        part = tl.sum(codes * x[None, :, :], axis=2)  # [BN, W]
        dot = tl.sum(tl.reshape(part, [BLOCK_N, GROUPS, G // 8]), axis=2)  # [BN, NG] sum code * x per group
        xsum = tl.sum(tl.reshape(tl.sum(x, axis=1), [GROUPS, G // 8]), axis=1)  # [NG] sum x per group
        g_off = rows64[:, None] * (K // G) + (k0 // G + groups)[None, :]  # [BN, NG]
        s = tl.load(s_ptr + g_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off, mask=row_ok[:, None], other=0).to(tl.float32)
        acc += s * (dot - z * xsum[None, :])
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=row_ok)


_gemv_int4_tuned = triton.autotune(configs=_int4_configs(), key=["N", "K", "G"],
                                   prune_configs_by={"early_config_prune": _prune_int4})(_gemv_int4_kernel)


@triton.jit
def _dequant_int4_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, G: tl.constexpr, BLOCK_N: tl.constexpr,
                         WORDS: tl.constexpr):
    # q: [N, K // 8] int32 -> w: [N, K] in w's dtype; one program per [BLOCK_N, 8 * WORDS] tile
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)  # [W]
    ok = (rows < N)[:, None] & (words < K // 8)[None, :]
    rows64 = rows.to(tl.int64)
    p = tl.load(q_ptr + rows64[:, None] * (K // 8) + words[None, :], mask=ok, other=0)  # [BN, W]
    j = tl.arange(0, 8)
    codes = ((p[:, :, None] >> (j * 4)[None, None, :]) & 0xF).to(tl.float32)  # [BN, W, 8]
    g_off = rows64[:, None] * (K // G) + (words * 8 // G)[None, :]  # [BN, W]
    s = tl.load(s_ptr + g_off, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_off, mask=ok, other=0).to(tl.float32)
    w = (codes - z[:, :, None]) * s[:, :, None]  # [BN, W, 8]
    cols = words[:, None] * 8 + j[None, :]  # [W, 8]
    tl.store(w_ptr + rows64[:, None, None] * K + cols[None, :, :], w.to(w_ptr.dtype.element_ty), mask=ok[:, :, None])


def _launch(tuned, kernel, grid, args: tuple, fixed: dict):
    """The autotuned kernel on a GPU; one fixed block size under the CPU interpreter."""
    if interpreted():
        kernel[grid(fixed)](*args, **fixed)
    else:
        tuned[grid](*args)


@torch.library.custom_op("llamactl::gemv_bf16", mutates_args=())
def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [K], w: [N, K] (contiguous) -> y: [N] in x's dtype."""
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _launch(_gemv_bf16_tuned, _gemv_bf16_kernel, lambda m: (triton.cdiv(n, m["BLOCK_N"]),),
            (x, w, w, y, n, k, False), {"BLOCK_N": 8, "BLOCK_K": 64})
    return y


@gemv_bf16.register_fake
def _(x, w):
    return x.new_empty(w.shape[0])


@torch.library.custom_op("llamactl::gemv_int8", mutates_args=())
def gemv_int8(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x: [K], w: [N, K] int8, scales: [N] -> y = (w x) * scales: [N] in x's dtype."""
    n, k = w.shape
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _launch(_gemv_bf16_tuned, _gemv_bf16_kernel, lambda m: (triton.cdiv(n, m["BLOCK_N"]),),
            (x, w, scales, y, n, k, True), {"BLOCK_N": 8, "BLOCK_K": 64})
    return y


@gemv_int8.register_fake
def _(x, w, scales):
    return x.new_empty(w.shape[0])


@torch.library.custom_op("llamactl::gemv_int4", mutates_args=())
def gemv_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """x: [K] -> y: [N] in x's dtype, for the 4-bit layout of this module's docstring."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    _launch(_gemv_int4_tuned, _gemv_int4_kernel, lambda m: (triton.cdiv(n, m["BLOCK_N"]),),
            (x, qweight, scales, zeros, y, n, k, group_size), {"BLOCK_N": 8, "BLOCK_K": group_size})
    return y


@gemv_int4.register_fake
def _(x, qweight, scales, zeros, group_size):
    return x.new_empty(qweight.shape[0])


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in `dtype` (prefill runs cuBLAS on it; tests compare against it)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    w = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, words = 32, 32
    _dequant_int4_kernel[(triton.cdiv(n, block_n), triton.cdiv(k // 8, words))](
        qweight, scales, zeros, w, n, k, group_size, BLOCK_N=block_n, WORDS=words)
    return w


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes: [N, K] integers in 0..15 -> [N, K // 8] int32, nibble j of word i = column 8 i + j."""
    n, k = codes.shape
    c = codes.to(torch.int64).view(n, k // 8, 8)
    words = (c << (torch.arange(8, device=codes.device) * 4)).sum(dim=-1)  # [N, K // 8] in 0..2^32-1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
