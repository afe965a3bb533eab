"""Prompt-sized products with 4-bit weights (a prefill's rows, past the decode kernels' 64): the
codes dequantized in registers, block by block, and multiplied on the tensor cores, instead of the
whole layer written out in 16 bits for cuBLAS and read back.

The layout is kernels.gemv's (qweight [N, K // 8] int32, nibble j of word i: column 8 i + j;
scales [N, K // G] fp16, zeros [N, K // G] uint8; w = (code - zero) * scale), with 5- and 6-bit
codes' high plane as kernels.int4_layout takes it. A program owns a [BLOCK_M, BLOCK_N] tile of the
output and walks K in blocks that lie in one group (G % BLOCK_K == 0), so each block takes one scale
and zero a column; the programs go through the tile grid column block by column block, GROUP_M row
blocks at a time, so a column block's weights are read from DRAM about once and from L2 after.

Each weight is dequantized once a row block, so the work per weight grows with M / BLOCK_M while
cuBLAS on a dequantized copy pays a fixed write and read of the 16-bit layer: `prefill_product`
takes this kernel up to GEMM_ROWS rows and the copy beyond (measured in docs/bench/README.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llamactl.kernels.device import interpreted
from llamactl.kernels.high_bits import column_high

# rows up to which prefill_product runs this kernel (past it: dequantize + cuBLAS); 0: never, as
# measured on the H100 (docs/bench/README.md, 2026-12-05)
GEMM_ROWS = 0


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, h_ptr, s_ptr, z_ptr, y_ptr, M, N, K, M_KEY, G: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      F32: tl.constexpr = False, HI: tl.constexpr = 0):
    # x: [M, K] 16-bit -> y: [M, N] in x's dtype; one program per [BLOCK_M, BLOCK_N] tile
    # (M_KEY: M's bucket, the autotuner's key, not read here)
    # HI = 1 or 2: 5- or 6-bit codes, w their low 4 bits and h [N, K // 8] uint8 / int16 (given as
    # int32) the high ones, bits HI j .. of word i's entry for column 8 i + j (kernels.high_bits)
    # F32: multiply in float32 (Triton's CPU interpreter gets bf16 dots wrong)
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n  # programs in a band of GROUP_M row blocks
    first_m = (pid // per_group) * GROUP_M
    band = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % band
    pid_n = (pid % per_group) // band
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok, n_ok = rm < M, rn < N
    dt: tl.constexpr = tl.float32 if F32 else x_ptr.dtype.element_ty
    prec: tl.constexpr = "ieee" if F32 else "tf32"
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K  # [BM, 1]
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * (K // 8)  # [BN, 1]
    if HI == 1:
        h_rows = h_ptr.to(tl.pointer_type(tl.uint8)) + rn.to(tl.int64)[:, None] * (K // 8)  # [BN, 1]
    else:
        h_rows = h_ptr.to(tl.pointer_type(tl.int16)) + rn.to(tl.int64)[:, None] * (K // 8)
    g_rows = rn.to(tl.int64) * (K // G)  # [BN]
    j = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8]
        p = tl.load(w_rows + words[None, :], mask=n_ok[:, None], other=0)  # [BN, BK/8]
        c = (p[:, :, None] >> (j * 4)[None, None, :]) & 0xF  # [BN, BK/8, 8]
        if HI > 0:
            h = tl.load(h_rows + words[None, :], mask=n_ok[:, None], other=0).to(tl.int32)  # [BN, BK/8]
            c = c | column_high(h[:, :, None], j[None, None, :], HI)
        s = tl.load(s_ptr + g_rows + k0 // G, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
        z = tl.load(z_ptr + g_rows + k0 // G, mask=n_ok, other=0).to(tl.float32)
        w = ((tl.reshape(c, (BLOCK_N, BLOCK_K)).to(tl.float32) - z[:, None]) * s[:, None]).to(dt)  # [BN, BK]
        x = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=m_ok[:, None], other=0.0).to(dt)  # [BM, BK]
        acc += tl.dot(x, tl.trans(w), input_precision=prec)  # [BM, BN]
    out = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in [(32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
                                      (64, 128, 128, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3),
                                      (128, 128, 128, 8, 3), (128, 256, 64, 8, 3)]]


def _prune(configs, named_args, **kwargs):
    """Blocks inside one group; no row block much past the rows."""
    g, rows = kwargs["G"], named_args["M_KEY"]
    kept = [c for c in configs if g % c.kwargs["BLOCK_K"] == 0 and c.kwargs["BLOCK_M"] <= max(32, rows)]
    return kept or [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4,
                                  num_stages=3)]


# the choice per shape and bucket of rows is kept in Triton's cache
_tuned = triton.autotune(configs=_configs(), key=["M_KEY", "N", "K", "G", "HI", "F32"],
                         prune_configs_by={"early_config_prune": _prune}, cache_results=True)(_int4_gemm_kernel)


def _rows_key(m: int) -> int:
    """The autotuner's bucket for m rows: a power of two (a new prompt length does not retune)."""
    return triton.next_power_of_2(m)


@torch.library.custom_op("llamactl::int4_mm", mutates_args=())
def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
            high: torch.Tensor | None = None, high_bits: int = 0) -> torch.Tensor:
    """x: [M, K] 16-bit, any M; the 4-bit layout of kernels.gemv (K % G == 0, G % 32 == 0); high,
    high_bits (1 or 2): 5- or 6-bit codes (kernels.int4_layout.dequantize_int4) -> x w^T: [M, N]."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if group_size % 32 or k % group_size:
        raise ValueError(f"int4 groups of {group_size} over {k} columns: need G % 32 == 0 and K % G == 0")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], not {tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (x, qweight, qweight if high is None else high, scales, zeros, y, m, n, k, _rows_key(m))
    if interpreted():
        bm, bn, bk = 32, 32, min(group_size, 64)
        _int4_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
            *args, G=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=2, F32=True, HI=high_bits)
    else:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        # float32 rows (tests, a CPU-built model moved over) are multiplied in float32, not tf32
        _tuned[grid](*args, G=group_size, F32=x.dtype == torch.float32, HI=high_bits)
    return y


@int4_mm.register_fake
def _(x, qweight, scales, zeros, group_size, high=None, high_bits=0):
    return x.new_empty(x.shape[0], qweight.shape[0])


def prefill_product(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int, high: torch.Tensor | None = None, high_bits: int = 0,
                    gemm_rows: int = GEMM_ROWS) -> torch.Tensor:
    """x [M, K] 16-bit (a prefill's rows) times the 4-bit layer: this module's kernel up to
    `gemm_rows` rows, else the layer dequantized to x's dtype for cuBLAS -> [M, N]."""
    if x.shape[0] <= gemm_rows:
        return int4_mm(x, qweight, scales, zeros, group_size, high, high_bits)
    from llamactl.kernels.int4_layout import dequantize_int4

    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, x.dtype, high, high_bits))


def prefill_name(bits: int, rows: int, gemm_rows: int = GEMM_ROWS) -> str:
    """What prefill_product runs for `rows` rows (bench rows name it)."""
    return f"int{bits} GEMM" if rows <= gemm_rows else f"int{bits} dequantize + cuBLAS"
