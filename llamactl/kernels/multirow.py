"""Matrix products Y = X W^T for a few rows (a decode batch of 2-64) that read each weight once,
with the rows as the MMA's first operand. The layers now take kernels.skinny (weights first) for
16-bit and int4 g128 layers up to 32 rows; these serve int8 layers, int4 layers of other groups
or not fusable, and int4 batches of 33-64 rows.

Batch-1 decoding runs the GEMVs of kernels.gemv; with B rows those would read every weight B
times. Here each program takes BLOCK_N output columns, streams their weights once for all rows
(BLOCK_M of them, 16 at least for tl.dot, the rest masked), dequantizes them in registers (int8:
per output channel; int4: the layout of kernels.gemv, one group's scale and zero per block) and
multiplies them on the tensor cores in bf16/fp16 with float32 sums.

int4 layers with groups of 128 columns or a multiple (GPTQ's and RTN's usual g128) take a
split-K kernel instead: SPLIT programs share a column block's K and add their float32 sums
atomically (so the summation order, and the last bits of a sum, may differ between runs). It
decodes up to 16 rows as the plane kernel does (8 nibble planes, 16-column dots), more with the
nibbles unpacked to contiguous columns and one 128-column dot; measured against the plane kernel,
torch's tinygemm and dequantize + cuBLAS in docs/bench/README.md (a probe: `git show 48f0ab6:scripts/int4_batch_probe.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels.device import interpreted
from llamactl.kernels.high_bits import column_high
from llamactl.kernels.planes import gemv_planes

# what the weight is (the kernel's KIND, written as literals there: Triton reads no plain globals):
W16, W8, W4 = 0, 1, 2  # 16-bit, int8 with per-row scales, int4 (kernels.gemv layout)
MAX_ROWS = 64  # rows these kernels are for; more is a prefill, for cuBLAS


def _configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)
            for bn, bk, warps, stages in [(16, 128, 2, 4), (16, 256, 4, 3), (32, 128, 4, 4), (32, 256, 4, 3),
                                          (64, 128, 4, 3), (64, 256, 8, 3), (128, 128, 8, 3), (16, 512, 4, 2),
                                          (32, 512, 8, 2), (16, 1024, 4, 2), (32, 1024, 8, 2), (64, 512, 8, 2)]]


def _prune(configs, named_args, **kwargs):
    """int4: blocks inside one group and of 128 columns at least (16 words: the dots' K); no
    block much past K."""
    k, g = named_args["K"], kwargs.get("G", named_args.get("G", 1))
    w4 = kwargs.get("KIND", W16) == W4
    kept = [c for c in configs if c.kwargs["BLOCK_K"] <= max(128, triton.next_power_of_2(k))
            and (not w4 or (c.kwargs["BLOCK_K"] >= 128 and g % c.kwargs["BLOCK_K"] == 0))]
    return kept or [triton.Config({"BLOCK_N": 32, "BLOCK_K": min(g, 128) if w4 else 64}, num_warps=2, num_stages=2)]


@triton.jit
def _multirow_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G: tl.constexpr, KIND: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr = False):
    # x: [M, K] 16-bit -> y: [M, N] in x's dtype; one program per (BLOCK_N columns, BLOCK_M rows)
    # KIND 0 (W16): w [N, K] 16-bit; 1 (W8): w [N, K] int8, s [N] (y = (x w^T) s);
    # 2 (W4): w [N, K // 8] int32 (nibble j of word i: column 8 i + j), s [N, K // G] fp16, z [N, K // G]
    # uint8, w[n, k] = (code - z) s; G % BLOCK_K == 0: a block lies in one group (blocks spanning
    # groups, with a scale gathered per word, decoded 25-30% slower on the H200). Nibble j of the
    # block's words meets x's columns 8 i + j (a strided load of x, which is small): 8 dots of
    # BLOCK_K / 8 columns, no reshuffling of the weights in registers
    # F32: multiply in float32 (Triton's CPU interpreter gets bf16 dots wrong)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_ok, n_ok = rm < M, rn < N
    dt: tl.constexpr = tl.float32 if F32 else x_ptr.dtype.element_ty
    prec: tl.constexpr = "ieee" if F32 else "tf32"
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K  # [BM, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if KIND == 2:  # W4
            words = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BK/8]
            ok = n_ok[:, None] & (words < K // 8)[None, :]  # [BN, BK/8] (a K tail is masked)
            p = tl.load(w_ptr + rn.to(tl.int64)[:, None] * (K // 8) + words[None, :], mask=ok, other=0)
            group = k0 // G  # the block's one group (G % BLOCK_K == 0)
            s = tl.load(s_ptr + rn.to(tl.int64) * (K // G) + group, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
            z = tl.load(z_ptr + rn.to(tl.int64) * (K // G) + group, mask=n_ok, other=0).to(tl.float32)
            for j in tl.static_range(8):
                w = ((((p >> (4 * j)) & 0xF).to(tl.float32) - z[:, None]) * s[:, None]).to(dt)  # [BN, BK/8]
                x = tl.load(x_rows + (words * 8 + j)[None, :], mask=m_ok[:, None] & (words < K // 8)[None, :],
                            other=0.0).to(dt)  # [BM, BK/8]
                acc += tl.dot(x, tl.trans(w), input_precision=prec)  # [BM, BN]
        else:
            kk = k0 + tl.arange(0, BLOCK_K)  # [BK]
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0).to(dt)  # [BM, BK]
            w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :],
                        other=0).to(dt)
            acc += tl.dot(x, tl.trans(w), input_precision=prec)  # [BM, BN]
    if KIND == 1:  # W8
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int4_splitk_kernel(x_ptr, w_ptr, h_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G: tl.constexpr, UNPACK: tl.constexpr,
                        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr = False,
                        HI: tl.constexpr = 0):
    # x: [M, K] 16-bit, w: [N, K // 8] int32 (nibble j of word i: column 8 i + j), s: [N, K // G]
    # fp16, z: [N, K // G] uint8 (G % 128 == 0) -> y: [M, N] float32, zeroed before: program
    # (n, k, m) adds its share of K's 128-column blocks (a block lies in one group)
    # HI = 1 or 2: 5- or 6-bit codes, w their low 4 bits and h [N, K // 8] uint8 / int16 (given as
    # int32) the high ones, bits HI j .. of word i's entry for column 8 i + j (kernels.high_bits)
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    blocks = K // 128
    per = tl.cdiv(blocks, SPLIT)
    for b in range(pid_k * per, tl.minimum(blocks, (pid_k + 1) * per)):
        words = b * 16 + tl.arange(0, 16)  # [16]
        p = tl.load(w_rows + words[None, :], mask=n_ok[:, None], other=0)  # [BN, 16]
        if HI > 0:
            h = tl.load(h_rows + words[None, :], mask=n_ok[:, None], other=0).to(tl.int32)  # [BN, 16]
        g = b * 128 // G
        s = tl.load(s_ptr + rn.to(tl.int64) * (K // G) + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
        z = tl.load(z_ptr + rn.to(tl.int64) * (K // G) + g, mask=n_ok, other=0).to(tl.float32)
        if UNPACK:  # contiguous columns, one dot of 128
            c = (p[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BN, 16, 8]
            if HI > 0:
                c = c | column_high(h[:, :, None], tl.arange(0, 8)[None, None, :], HI)
            w = ((tl.reshape(c, (BLOCK_N, 128)).to(tl.float32) - z[:, None]) * s[:, None]).to(dt)  # [BN, 128]
            x = tl.load(x_rows + (b * 128 + tl.arange(0, 128))[None, :], mask=m_ok[:, None], other=0.0).to(dt)
            acc += tl.dot(x, tl.trans(w), input_precision=prec)  # [BM, BN]
        else:  # nibble plane j meets x's columns 8 i + j
            for j in tl.static_range(8):
                c = (p >> (4 * j)) & 0xF  # [BN, 16]
                if HI > 0:
                    c = c | column_high(h, j, HI)
                w = ((c.to(tl.float32) - z[:, None]) * s[:, None]).to(dt)  # [BN, 16]
                x = tl.load(x_rows + (words * 8 + j)[None, :], mask=m_ok[:, None], other=0.0).to(dt)  # [BM, 16]
                acc += tl.dot(x, tl.trans(w), input_precision=prec)
    tl.atomic_add(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


# the choice per shape is kept in Triton's cache
_tuned = triton.autotune(configs=_configs(), key=["BLOCK_M", "N", "K", "G", "KIND"],
                         prune_configs_by={"early_config_prune": _prune}, cache_results=True)(_multirow_kernel)


# 5- and 6-bit codes (HI) tune 64-column blocks only: a third of the compiles
_splitk_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "SPLIT": sp}, num_warps=w, num_stages=st)
             for bn in (32, 64, 128) for sp in (1, 2, 4, 8) for w, st in ((4, 3), (8, 4))],
    key=["BLOCK_M", "N", "K", "G", "UNPACK", "HI"], reset_to_zero=["y_ptr"], cache_results=True,
    prune_configs_by={"early_config_prune": lambda configs, named, **kw: [
        c for c in configs if not kw.get("HI") or c.kwargs["BLOCK_N"] == 64]})(_int4_splitk_kernel)


def splitk_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, unpack: bool | None = None, high: torch.Tensor | None = None,
                high_bits: int = 0) -> torch.Tensor:
    """multirow_int4 for groups of a multiple of 128 columns (checked there): x [M, K] -> [M, N].
    unpack: contiguous columns (True) or nibble planes (False); None: past 16 rows. high,
    high_bits: 5- or 6-bit codes (multirow_int4)."""
    m, k = x.shape
    unpack = m > 16 if unpack is None else unpack
    n = qweight.shape[0]
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    args = (x, qweight, qweight if high is None else high, scales, zeros, y, m, n, k)
    if interpreted():  # two splits: the atomic sums are exercised
        _int4_splitk_kernel[(triton.cdiv(n, 32), 2, 1)](*args, G=group_size, UNPACK=unpack, SPLIT=2,
                                                        BLOCK_M=block_m, BLOCK_N=32, F32=True, HI=high_bits)
    else:
        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"], triton.cdiv(m, block_m))

        _splitk_tuned[grid](*args, G=group_size, UNPACK=unpack, BLOCK_M=block_m, HI=high_bits)
    return y.to(x.dtype)


def splitk_takes(group_size: int) -> bool:
    """Whether multirow_int4 runs the split-K kernel for these groups (else the plane kernel)."""
    return group_size % 128 == 0


def int4_rows(group_size: int) -> int:
    """The most rows multirow_int4 is for with these groups (more: dequantize + cuBLAS). Measured on
    the H200 (llama2-7b shapes, docs/bench/README.md): the split-K kernel was 2.3x dequantize +
    cuBLAS at 32 rows, and the plane kernel behind it above 16, with the tiled dequantizing kernel
    that the flat one (3.8x faster) replaced; not yet measured again."""
    return MAX_ROWS if splitk_takes(group_size) else 16


def _launch(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, z: torch.Tensor | None, n: int, k: int,
            g: int, kind: int) -> torch.Tensor:
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))
    args = (x, w, w if s is None else s, w if z is None else z, y, m, n, k)
    if interpreted():
        bk = min(g, 128) if kind == W4 else 32
        _multirow_kernel[(triton.cdiv(n, 32), 1)](*args, G=g, KIND=kind, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=bk,
                                                  F32=True)
    else:
        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m))

        _tuned[grid](*args, G=g, KIND=kind, BLOCK_M=block_m)
    return y


def _check(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], not {tuple(x.shape)}")
    if not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"multirow products take 1 to {MAX_ROWS} rows, not {x.shape[0]}")
    return x.contiguous()


@torch.library.custom_op("llamactl::multirow_mm", mutates_args=())
def multirow_mm(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] 16-bit (M <= MAX_ROWS), w: [N, K] 16-bit, or int8 with scales [N] -> x w^T (* scales): [M, N]."""
    n, k = w.shape
    return _launch(_check(x, k), w, scales, None, n, k, 1, W8 if w.dtype == torch.int8 else W16)


@multirow_mm.register_fake
def _(x, w, scales=None):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("llamactl::multirow_int4", mutates_args=())
def multirow_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, high: torch.Tensor | None = None, high_bits: int = 0) -> torch.Tensor:
    """x: [M, K] 16-bit (M <= MAX_ROWS), the 4-bit layout of kernels.gemv (qweight [N, K // 8] int32,
    scales [N, K // G] fp16, zeros [N, K // G] uint8; K % G == 0, G % 32 == 0) -> [M, N]. high,
    high_bits (1 or 2): 5- or 6-bit codes, qweight their low 4 bits, high [N, K * high_bits / 32]
    int32 the rest (kernels.high_bits); groups of a multiple of 128 on the split-K kernel, others
    on the plane kernel (kernels.planes)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if group_size % 32 or k % group_size:
        raise ValueError(f"int4 groups of {group_size} over {k} columns: need G % 32 == 0 and K % G == 0")
    if splitk_takes(group_size):
        return splitk_int4(_check(x, k), qweight, scales, zeros, group_size, high=high, high_bits=high_bits)
    if high_bits:
        return gemv_planes(_check(x, k), qweight, high, scales, zeros, 4, high_bits, group_size)
    return _launch(_check(x, k), qweight, scales, zeros, n, k, group_size, W4)


@multirow_int4.register_fake
def _(x, qweight, scales, zeros, group_size, high=None, high_bits=0):
    return x.new_empty(x.shape[0], qweight.shape[0])
