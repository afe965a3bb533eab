"""Skinny products Y = X W^T for a decode batch (2-64 rows) with the weights as the MMA's first
operand: y^T [BN, BM] += w [BN, BK] x^T [BK, BM].

kernels.multirow puts the rows first (x w^T): the batch is the MMA's M, padded to 16 rows, and on
the H200 the weights, the large operand, become the second operand, which the tensor cores read
from shared memory (for int4: dequantized in registers, stored there, loaded back). Swapped, the
weights' BN rows fill the M of the H200's warp-group MMA (64 or 128), which takes its first
operand from registers (int4) or straight from the shared memory the loads filled (16-bit), and
the rows are the small N (16 or 32). That is how tinygemm and Marlin arrange it.

int4 codes become 16-bit numbers of x's dtype by the magic-number trick (Marlin's): a nibble
OR-ed into the mantissa of 128.0 (bf16, 0x4300) or 1024.0 (fp16, 0x6400) is that number plus the
code, two nibbles a 32-bit operation, with no integer-to-float conversion (a quarter-rate
instruction on the H200). Minus (magic + zero point), exact: code - zero, small integers the dot
multiplies with x as it is (no conversion of x); the group's scale then multiplies each block's
float32 sums, once a block and row (the multirow kernels round (code - zero) * scale to bf16 per
weight). The 8 nibble planes of a block are either joined into one 128-column operand (x loaded
in the joins' column order) or dotted a plane at a time (K = 16): the autotuner picks per shape.

Several programs (SPLIT) share a column block's K range where a layer has too few blocks to fill
the GPU. Each stores its float32 share in a workspace and counts itself in; the last to arrive
adds the shares in a fixed order and writes y, so sums do not depend on timing (the multirow
split-K kernel's float32 atomics do) and no zeroing or conversion kernel runs around the product.
The counters are one int32 tensor a device, left at zero by every launch (so launches on one
device must not overlap: one stream at a time, as the decode step and the server run them).

int8 weights (per-row scales) take the 16-bit kernel (their codes are exact in bf16 and fp16,
converted in registers; each row's scale multiplies its float32 sums, kernels.multirow's
rounding), or skinny_int8: the weights go to the int8 MMA as they are, with no conversion, and x
is the batch-1 GEMVs' 16-bit fixed point (kernels.int16_inputs), split into two int8 operands.
Each row's 128-column block is scaled by 2^(13 - e), 2^e <= max |x| < 2^(e + 1), and rounded to
v (|v| <= 2^14): inputs within 2^6 of the block's largest are exact in bf16, smaller ones rounded
to 2^-14 of the largest (bf16 itself rounds the largest to 2^-9 of it). v = 256 hi + lo with hi,
lo int8; the two int32 dots, 256 dot(w, hi) + dot(w, lo), are exact, and one float scale a block
and row, 2^(e - 13), takes them to float32. The scale blocks are 128 columns whatever the tile.

PDL (programmatic dependent launch, as the batch-1 GEMVs): a product may start while the kernel
before it runs; it waits for that kernel before reading x (its output) or writing anything, the
16-bit one after loading its first block of weights, and then lets the next kernel start.

Epilogue: y rounded to x's dtype, then (RES) a residual added and rounded again (PyTorch's
residual + linear(x)). GLU: x is a fused [gate; up] output [M, 2K], and silu(gate) * up (PyTorch's
roundings, as kernels.glue) is what multiplies the weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llamactl.kernels.device import interpreted, pdl_launch
from llamactl.kernels.gdc import wait_for_previous
from llamactl.kernels.int8_inputs import _round

MAX_ROWS = 64
# the most rows the layers give these products: at 64, cuBLAS was faster for 16-bit layers, and
# int4 at 33-64 rows stays on the split-K kernel, not yet compared (docs/bench/README.md, skinny section)
LAYER_ROWS = 32
MAX_SPLIT = 16  # the autotuner's largest share count: the workspace's first dimension
_counters: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device, blocks: int) -> torch.Tensor:
    """The device's counters (zero between launches). The first call for a device must not be
    under CUDA graph capture (nor is Triton's autotuning)."""
    c = _counters.get(device)
    if c is None or c.numel() < blocks:
        c = _counters[device] = torch.zeros(max(blocks, 8192), dtype=torch.int32, device=device)
    return c


@triton.jit
def _x_tile(x_ptr, rm, m_ok, kk, k_ok, K, GLU: tl.constexpr, ROWS: tl.constexpr = False):
    # x^T's tile [BK, BM] (ROWS: x's [BM, BK]): x [M, K] (GLU: h [M, 2K], silu(gate) * up with
    # PyTorch's roundings)
    if ROWS:
        offs, ok = rm.to(tl.int64)[:, None] * (2 * K if GLU else K) + kk[None, :], m_ok[:, None] & k_ok[None, :]
    else:
        offs, ok = rm.to(tl.int64)[None, :] * (2 * K if GLU else K) + kk[:, None], m_ok[None, :] & k_ok[:, None]
    if GLU:
        g = tl.load(x_ptr + offs, mask=ok, other=0.0)
        u = tl.load(x_ptr + offs + K, mask=ok, other=0.0)
        gf = g.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
        return (silu.to(tl.float32) * u.to(tl.float32)).to(g.dtype)
    return tl.load(x_ptr + offs, mask=ok, other=0.0)


@triton.jit
def _finish(acc, y_ptr, r_ptr, part_ptr, cnt_ptr, rm, rn, m_ok, n_ok, M, N, pid_n, pid_k,
            SPLIT: tl.constexpr, RES: tl.constexpr):
    # acc: [BN, BM] float32, this program's share of y^T's block; y, r: [M, N] in y's dtype;
    # part: [SPLIT, M, N] float32 workspace; cnt: [>= N / BN] int32, zero
    offs = rm.to(tl.int64)[None, :] * N + rn[:, None]  # [BN, BM]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        y = acc.to(y_ptr.dtype.element_ty)
        if RES:
            y = (y.to(tl.float32) + tl.load(r_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, y, mask=ok)
    else:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + offs, acc, mask=ok)
        tl.debug_barrier()  # every thread's share stored before the count
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:  # the last of the block's programs: add the shares in order
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT):
                total += tl.load(part_ptr + s * M * N + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0)
            y = total.to(y_ptr.dtype.element_ty)
            if RES:
                y = (y.to(tl.float32) + tl.load(r_ptr + offs, mask=ok, other=0.0).to(tl.float32)).to(
                    y_ptr.dtype.element_ty)
            tl.store(y_ptr + offs, y, mask=ok)


@triton.jit
def _dot(w, xt, acc, F32: tl.constexpr):
    # acc [BN, BM] + w [BN, BK] x^T [BK, BM]; F32: in float32 (Triton's CPU interpreter gets 16-bit dots wrong)
    if F32:
        return acc + tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    return tl.dot(w, xt.to(w.dtype), acc)


@triton.jit
def _halves(q, dt: tl.constexpr):
    # q: int32 holding two 16-bit floats of type dt -> (low, high), each of q's shape
    lo = (q & 0xFFFF).to(tl.int16).to(dt, bitcast=True)
    hi = (q >> 16).to(tl.int16).to(dt, bitcast=True)
    return lo, hi


@triton.jit
def _minus(v, z, F32: tl.constexpr):
    # v [BN, K'] - z [BN] (F32: in float32: the interpreter's 16-bit arithmetic is not the GPU's)
    if F32:
        return v.to(tl.float32) - z.to(tl.float32)[:, None]
    return v - z[:, None]


@triton.jit
def _plane(acc, w, x_ptr, rm, m_ok, kk, K, GLU: tl.constexpr, F32: tl.constexpr):
    # acc [BN, BM] + w [BN, 16] x^T's rows kk [16, BM]
    return _dot(w, _x_tile(x_ptr, rm, m_ok, kk, kk < K, K, GLU), acc, F32)


@triton.jit
def _program(M, N, blocks, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # this program's column block (n) and share of K's `blocks` (k): its rows, columns, masks, and
    # its blocks [lo, hi) (empty for the last shares where SPLIT does not divide them)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    per = tl.cdiv(blocks, SPLIT)
    return pid_n, pid_k, rm, rn, rm < M, rn < N, pid_k * per, tl.minimum(blocks, (pid_k + 1) * per)


@triton.jit(do_not_specialize=["M"])  # M: masks only; a new row count compiles nothing
def _w16_kernel(x_ptr, w_ptr, s_ptr, r_ptr, part_ptr, cnt_ptr, y_ptr, M, N, K, SPLIT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RES: tl.constexpr,
                GLU: tl.constexpr, W8: tl.constexpr = False, PDL: tl.constexpr = False, F32: tl.constexpr = False):
    # x: [M, K] 16-bit (GLU: [M, 2K]), w: [N, K] of x's dtype -> y: [M, N]; program (n block, k share)
    # W8: w int8 [N, K] (exact in bf16 and fp16) and s [N] its rows' scales: y = (x w^T) s
    # PDL (programmatic dependent launch, kernels.pdl): the share's first block of weights, which
    # nothing writes, is loaded before waiting for the kernel before (whose output x is), and its
    # iteration peeled off; then the next kernel may start launching
    pid_n, pid_k, rm, rn, m_ok, n_ok, lo, hi = _program(M, N, tl.cdiv(K, BLOCK_K), SPLIT, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K  # [BN, 1]
    first = lo
    if PDL:
        kk = lo * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = (kk < K) & (lo < hi)  # (an empty share adds nothing)
        w = _w16_block(w_rows, kk, n_ok, k_ok, x_ptr, W8, F32)  # [BN, BK]
        wait_for_previous(PDL)
        acc = _dot(w, _x_tile(x_ptr, rm, m_ok, kk, k_ok, K, GLU), acc, F32)  # [BN, BM]
        first = lo + 1
    for b in range(first, hi):
        kk = b * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        k_ok = kk < K
        w = _w16_block(w_rows, kk, n_ok, k_ok, x_ptr, W8, F32)  # [BN, BK]
        acc = _dot(w, _x_tile(x_ptr, rm, m_ok, kk, k_ok, K, GLU), acc, F32)  # [BN, BM]
    if W8:
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    _finish(acc, y_ptr, r_ptr, part_ptr, cnt_ptr, rm, rn, m_ok, n_ok, M, N, pid_n, pid_k, SPLIT, RES)


@triton.jit
def _w16_block(w_rows, kk, n_ok, k_ok, x_ptr, W8: tl.constexpr, F32: tl.constexpr):
    # the weights' block [BN, BK] at columns kk, in x's dtype (W8: int8 codes converted, exact;
    # F32: to float32, the interpreter's int8-to-bf16 conversion is not the GPU's)
    w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
    if W8:
        w = w.to(tl.float32 if F32 else x_ptr.dtype.element_ty)
    return w


@triton.jit
def _scales16(amax):
    # amax [BM] float32, the largest |x| of each row's block -> (up, down) [BM] float32: 2^(13 - e)
    # and 2^(e - 13), 2^e <= amax < 2^(e + 1) (e at least -113)
    e_bits = tl.maximum(amax.to(tl.int32, bitcast=True) & 0x7F800000, 14 << 23)  # e + 127, at least 14
    return (0x7F000000 - e_bits + (13 << 23)).to(tl.float32, bitcast=True), (e_bits - (13 << 23)).to(
        tl.float32, bitcast=True)


@triton.jit
def _split16(xt, up, F32: tl.constexpr):
    # xt [BK, BM] 16-bit, up [BM] -> (hi, lo) int8 [BK, BM] and the sums of v [BM] int32: v = x up
    # rounded (|v| <= 2^14) = 256 hi + lo
    v = _round(xt.to(tl.float32), up[None, :], not F32)  # [BK, BM] int32
    hi = (v + 128) >> 8  # [-64, 64]
    return hi.to(tl.int8), (v - hi * 256).to(tl.int8), tl.sum(v, axis=0)


@triton.jit
def _fixed16(xt, F32: tl.constexpr):
    # xt [128, BM] 16-bit -> (hi, lo) int8 [128, BM], down [BM] float32 and the sums of v [BM]
    # int32: each row's block in fixed point, x ~ v down, v = 256 hi + lo (the module's docstring)
    up, down = _scales16(tl.max(tl.abs(xt.to(tl.float32)), axis=0))
    hi, lo, vsum = _split16(xt, up, F32)
    return hi, lo, down, vsum


@triton.jit
def _idot(w, xt, F32: tl.constexpr):
    # w [BN, BK] int8, xt [BK, BM] int8 -> [BN, BM] int32 (F32: as float32 dots of the integers, exact)
    if F32:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee").to(tl.int32)
    return tl.dot(w, xt, out_dtype=tl.int32)


@triton.jit(do_not_specialize=["M"])  # M: masks only; a new row count compiles nothing
def _w8_kernel(x_ptr, w_ptr, s_ptr, r_ptr, part_ptr, cnt_ptr, y_ptr, M, N, K, SPLIT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RES: tl.constexpr, GLU: tl.constexpr,
               PDL: tl.constexpr = False, F32: tl.constexpr = False):
    # x: [M, K] 16-bit (GLU: [M, 2K]), w: [N, K] int8, s: [N] its rows' scales -> y: [M, N]; program
    # (n block, k share) of K's 128-column blocks; x in 16-bit fixed point, two int8 dots a block
    wait_for_previous(PDL)
    pid_n, pid_k, rm, rn, m_ok, n_ok, first, end = _program(M, N, tl.cdiv(K, 128), SPLIT, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K  # [BN, 1]
    for b in range(first, end):
        kk = b * 128 + tl.arange(0, 128)  # [128]
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)  # [BN, 128] int8
        hi, lo, down, _ = _fixed16(_x_tile(x_ptr, rm, m_ok, kk, k_ok, K, GLU), F32)  # [128, BM] x2, [BM]
        d = _idot(w, hi, F32) * 256 + _idot(w, lo, F32)  # [BN, BM] int32, exact
        acc += d.to(tl.float32) * down[None, :]
    acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    _finish(acc, y_ptr, r_ptr, part_ptr, cnt_ptr, rm, rn, m_ok, n_ok, M, N, pid_n, pid_k, SPLIT, RES)


@triton.jit(do_not_specialize=["M"])  # M: masks only; a new row count compiles nothing
def _w4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, r_ptr, part_ptr, cnt_ptr, y_ptr, M, N, K, G: tl.constexpr,
               SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RES: tl.constexpr,
               GLU: tl.constexpr, JOIN: tl.constexpr = True, PDL: tl.constexpr = False,
               F32: tl.constexpr = False):
    # x: [M, K] 16-bit (GLU: [M, 2K]); w: [N, K // 8] int32 (nibble j of word i: column 8 i + j),
    # s: [N, K // G] fp16, z: [N, K // G] uint8 (G % 128 == 0) -> y: [M, N]; program (n block, k
    # share) of K's 128-column blocks (a block lies in one group). Nibbles j and j + 4 of a word come
    # out of one 32-bit operation as x's dtype's magic number + code (bf16: 128, fp16: 1024); minus
    # magic + zero: code - zero, exact; the dot of those small integers with x, then times the
    # group's scale (float32), once a block and row.
    # JOIN: the block's 8 nibble planes joined into one [BN, 128] operand (columns in the joins'
    # order, x loaded in the same order): one dot a block; else one K=16 dot a plane
    wait_for_previous(PDL)
    pid_n, pid_k, rm, rn, m_ok, n_ok, lo, hi = _program(M, N, K // 128, SPLIT, BLOCK_M, BLOCK_N)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * (K // 8)  # [BN, 1]
    dt: tl.constexpr = x_ptr.dtype.element_ty
    BF16: tl.constexpr = dt == tl.bfloat16
    magic: tl.constexpr = 0x43004300 if BF16 else 0x64006400
    offset: tl.constexpr = 128.0 if BF16 else 1024.0
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    t = tl.arange(0, 128)
    # the joins' column order: position t holds column 8 (t >> 3) + nibble 4 (t & 1) + 2 ((t >> 1) & 1) + ((t >> 2) & 1)
    perm = 8 * (t >> 3) + 4 * (t & 1) + 2 * ((t >> 1) & 1) + ((t >> 2) & 1)  # [128]
    for b in range(lo, hi):
        words = b * 16 + tl.arange(0, 16)  # [16]
        p = tl.load(w_rows + words[None, :], mask=n_ok[:, None], other=0)  # [BN, 16] int32
        g = b * 128 // G
        s = tl.load(s_ptr + rn.to(tl.int64) * (K // G) + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
        z = (tl.load(z_ptr + rn.to(tl.int64) * (K // G) + g, mask=n_ok, other=0).to(tl.float32) + offset).to(dt)
        lo0, hi0 = _halves((p & 0x000F000F) | magic, dt)  # [BN, 16] each: magic + nibble 0, 4
        lo1, hi1 = _halves(((p >> 4) & 0x000F000F) | magic, dt)
        lo2, hi2 = _halves(((p >> 8) & 0x000F000F) | magic, dt)
        lo3, hi3 = _halves(((p >> 12) & 0x000F000F) | magic, dt)
        if JOIN:
            v = tl.join(tl.join(tl.join(lo0, lo1), tl.join(lo2, lo3)), tl.join(tl.join(hi0, hi1), tl.join(hi2, hi3)))
            w = _minus(tl.reshape(v, (BLOCK_N, 128)), z, F32)  # [BN, 128]: code - zero, column perm[t]
            kk = b * 128 + perm
            xt = _x_tile(x_ptr, rm, m_ok, kk, kk < K, K, GLU)  # [128, BM]
            part = _dot(w, xt, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), F32)
        else:
            part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            part = _plane(part, _minus(lo0, z, F32), x_ptr, rm, m_ok, words * 8, K, GLU, F32)
            part = _plane(part, _minus(lo1, z, F32), x_ptr, rm, m_ok, words * 8 + 1, K, GLU, F32)
            part = _plane(part, _minus(lo2, z, F32), x_ptr, rm, m_ok, words * 8 + 2, K, GLU, F32)
            part = _plane(part, _minus(lo3, z, F32), x_ptr, rm, m_ok, words * 8 + 3, K, GLU, F32)
            part = _plane(part, _minus(hi0, z, F32), x_ptr, rm, m_ok, words * 8 + 4, K, GLU, F32)
            part = _plane(part, _minus(hi1, z, F32), x_ptr, rm, m_ok, words * 8 + 5, K, GLU, F32)
            part = _plane(part, _minus(hi2, z, F32), x_ptr, rm, m_ok, words * 8 + 6, K, GLU, F32)
            part = _plane(part, _minus(hi3, z, F32), x_ptr, rm, m_ok, words * 8 + 7, K, GLU, F32)
        acc += part * s[:, None]
    _finish(acc, y_ptr, r_ptr, part_ptr, cnt_ptr, rm, rn, m_ok, n_ok, M, N, pid_n, pid_k, SPLIT, RES)


@triton.jit(do_not_specialize=["M"])  # M: masks only; a new row count compiles nothing
def _w4i8_kernel(x_ptr, w_ptr, s_ptr, z_ptr, r_ptr, part_ptr, cnt_ptr, y_ptr, M, N, K, G: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RES: tl.constexpr,
                 GLU: tl.constexpr, PDL: tl.constexpr = False, F32: tl.constexpr = False):
    # x: [M, K] 16-bit (GLU: [M, 2K]); w: [N, K // 2] uint8, kernels.gemv's int32 words as bytes
    # (byte t: column 2t in its low nibble, 2t + 1 in its high), s: [N, K // G] fp16, z: [N, K // G]
    # uint8 (G % 128 == 0) -> y: [M, N]; program (n block, k share) of K's 128-column blocks.
    # The even columns' codes are the bytes AND 0x0F, the odd ones' 16 (code - 8) = the bytes XOR
    # 0x80 AND 0xF0 as int8 (one logical operation on four bytes), both int8 MMA operands as they
    # are; x's block in skinny_int8's 16-bit fixed point (v = 256 hi + lo, its even and odd columns
    # apart). dot(code - zero, v) = dot(c_even, v_even) + dot(16 (c_odd - 8), v_odd) / 16
    # + 8 sum(v_odd) - zero sum(v), exact in int32; then times 2^(e - 13) and the group's scale
    # (float32), once a block and row.
    wait_for_previous(PDL)
    pid_n, pid_k, rm, rn, m_ok, n_ok, first, end = _program(M, N, K // 128, SPLIT, BLOCK_M, BLOCK_N)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * (K // 2)  # [BN, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for b in range(first, end):
        q = tl.load(w_rows + (b * 64 + tl.arange(0, 64))[None, :], mask=n_ok[:, None], other=0)  # [BN, 64] uint8
        g = b * 128 // G
        s = tl.load(s_ptr + rn.to(tl.int64) * (K // G) + g, mask=n_ok, other=0.0).to(tl.float32)  # [BN]
        z = tl.load(z_ptr + rn.to(tl.int64) * (K // G) + g, mask=n_ok, other=0).to(tl.int32)  # [BN]
        even = (q & 0x0F).to(tl.int8, bitcast=True)  # [BN, 64]
        odd = ((q ^ 0x80) & 0xF0).to(tl.int8, bitcast=True)  # [BN, 64]
        kk = b * 128 + tl.arange(0, 128)  # [128]
        xr = _x_tile(x_ptr, rm, m_ok, kk, kk < K, K, GLU, ROWS=True)  # [BM, 128]
        up, down = _scales16(tl.max(tl.abs(xr.to(tl.float32)), axis=1))  # [BM] x2
        xe, xo = tl.split(tl.reshape(xr, (BLOCK_M, 64, 2)))  # [BM, 64] x2
        he, le, se = _split16(tl.trans(xe), up, F32)  # [64, BM] x2, [BM]
        ho, lo, so = _split16(tl.trans(xo), up, F32)
        do = _idot(odd, ho, F32) * 256 + _idot(odd, lo, F32)  # [BN, BM]: 16 dot(c_odd - 8, v_odd)
        d = (_idot(even, he, F32) * 256 + _idot(even, le, F32) + (do >> 4)
             + 8 * so[None, :] - z[:, None] * (se + so)[None, :])  # dot(c - z, v): exact
        acc += d.to(tl.float32) * down[None, :] * s[:, None]
    _finish(acc, y_ptr, r_ptr, part_ptr, cnt_ptr, rm, rn, m_ok, n_ok, M, N, pid_n, pid_k, SPLIT, RES)


def _configs16():
    # the shapes the H200 chose among 24 for llama2-7b's layers at 8-32 rows (`git show 48f0ab6:scripts/skinny_probe.py`)
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": sp}, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((64, 64, 4, 6), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 4))
            for sp in (1, 2, 4, 8)]


def _configs8(most_split: int = 8):
    return [triton.Config({"BLOCK_N": bn, "SPLIT": sp}, num_warps=w, num_stages=st)
            for bn, w, st in ((64, 4, 4), (128, 4, 4), (128, 8, 4), (256, 8, 3))
            for sp in (1, 2, 4, 8, 16) if sp <= most_split]


def _configs4():
    return [triton.Config({"BLOCK_N": bn, "SPLIT": sp, "JOIN": join}, num_warps=w, num_stages=st)
            for bn, w, st in ((64, 4, 3), (128, 4, 3), (128, 8, 4))
            for sp in (2, 4, 8, 16) for join in (True, False)]


_w16_tuned = triton.autotune(configs=_configs16(), key=["BLOCK_M", "N", "K", "RES", "GLU", "W8", "PDL"],
                             cache_results=True)(_w16_kernel)
_w8_tuned = triton.autotune(configs=_configs8(), key=["BLOCK_M", "N", "K", "RES", "GLU", "PDL"],
                            cache_results=True)(_w8_kernel)
_w4i8_tuned = triton.autotune(configs=_configs8(16), key=["BLOCK_M", "N", "K", "G", "RES", "GLU", "PDL"],
                              cache_results=True)(_w4i8_kernel)
_w4_tuned = triton.autotune(configs=_configs4(), key=["BLOCK_M", "N", "K", "G", "RES", "GLU", "PDL"],
                            cache_results=True)(_w4_kernel)


def _rows(x: torch.Tensor, k: int, glu: bool) -> torch.Tensor:
    width = 2 * k if glu else k
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"x must be [M, {width}], not {tuple(x.shape)}")
    if not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"skinny products take 1 to {MAX_ROWS} rows, not {x.shape[0]}")
    if x.dtype not in (torch.float16, torch.bfloat16):  # float32 would multiply in TF32
        raise ValueError(f"skinny products take fp16 or bf16 rows, not {x.dtype}")
    return x.contiguous()


def _launch(kernel, tuned, x, w_args, n, k, residual, glu, extra, pdl=False):
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(MAX_SPLIT, m, n, dtype=torch.float32, device=x.device)
    cnt = _counter(x.device, triton.cdiv(n, 32))
    r = y if residual is None else residual.contiguous()
    block_m = max(16, triton.next_power_of_2(m))
    args = (x, *w_args, r, part, cnt, y, m, n, k)
    flags = dict(BLOCK_M=block_m, RES=residual is not None, GLU=glu, **extra)
    if interpreted():  # two shares of K: the workspace and the counters are exercised
        kernel[(triton.cdiv(n, 32), 2)](*args, SPLIT=2, BLOCK_N=32, F32=True, **flags,
                                        **({"BLOCK_K": 32} if kernel is _w16_kernel else {}))
    else:  # (the interpreter has no PDL: no PTX)
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](*args, **flags, **pdl_launch(pdl))
    return y


@torch.library.custom_op("llamactl::skinny_mm", mutates_args=())
def skinny_mm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None, glu: bool = False,
              scales: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x: [M, K] 16-bit (glu: [M, 2K], silu(gate) * up multiplied), w: [N, K] of x's dtype, or int8
    with scales [N] (y = (x w^T) scales), residual: [M, N] or None -> x w^T (+ residual): [M, N],
    M <= MAX_ROWS; pdl: a programmatic dependent launch (the first weights read before waiting for
    the kernel before)."""
    n, k = w.shape
    w8 = w.dtype == torch.int8
    if w8 != (scales is not None) or (not w8 and w.dtype != x.dtype):
        raise ValueError(f"skinny_mm: a weight of x's dtype ({x.dtype}), or int8 with scales, not {w.dtype}"
                         f"{' with' if scales is not None else ' without'} scales")
    return _launch(_w16_kernel, _w16_tuned, _rows(x, k, glu), (w, w if scales is None else scales), n, k, residual,
                   glu, {"W8": w8}, pdl)


@torch.library.custom_op("llamactl::skinny_int4", mutates_args=())
def skinny_int4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                residual: torch.Tensor | None = None, glu: bool = False, pdl: bool = False) -> torch.Tensor:
    """x: [M, K] 16-bit (glu: [M, 2K]), the 4-bit layout of kernels.gemv with groups of a multiple of
    128 columns (qweight [N, K // 8] int32, scales [N, K // G] fp16, zeros [N, K // G] uint8) ->
    x w^T (+ residual): [M, N], M <= MAX_ROWS; pdl: a programmatic dependent launch."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if group_size % 128 or k % group_size:
        raise ValueError(f"skinny int4 takes groups of a multiple of 128 dividing {k} columns, not {group_size}")
    return _launch(_w4_kernel, _w4_tuned, _rows(x, k, glu), (qweight, scales, zeros), n, k, residual, glu,
                   {"G": group_size}, pdl)


@torch.library.custom_op("llamactl::skinny_int8", mutates_args=())
def skinny_int8(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor | None = None,
                glu: bool = False, pdl: bool = False) -> torch.Tensor:
    """x: [M, K] 16-bit (glu: [M, 2K]) in 16-bit fixed point a 128-column block, w: [N, K] int8,
    scales [N] -> (x w^T) scales (+ residual): [M, N] on the int8 MMA, M <= MAX_ROWS; pdl: a
    programmatic dependent launch."""
    n, k = w.shape
    if w.dtype != torch.int8:
        raise ValueError(f"skinny_int8: int8 weights, not {w.dtype}")
    return _launch(_w8_kernel, _w8_tuned, _rows(x, k, glu), (w, scales), n, k, residual, glu, {}, pdl)


@torch.library.custom_op("llamactl::skinny_int4_i8", mutates_args=())
def skinny_int4_i8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   group_size: int, residual: torch.Tensor | None = None, glu: bool = False,
                   pdl: bool = False) -> torch.Tensor:
    """skinny_int4's product on the int8 MMA: the codes as they are, x in skinny_int8's 16-bit
    fixed point a 128-column block -> x w^T (+ residual): [M, N], M <= MAX_ROWS; pdl: a programmatic
    dependent launch."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if group_size % 128 or k % group_size:
        raise ValueError(f"skinny int4 takes groups of a multiple of 128 dividing {k} columns, not {group_size}")
    return _launch(_w4i8_kernel, _w4i8_tuned, _rows(x, k, glu), (qweight.view(torch.uint8), scales, zeros), n, k,
                   residual, glu, {"G": group_size}, pdl)


@skinny_mm.register_fake
def _(x, w, residual=None, glu=False, scales=None, pdl=False):
    return x.new_empty(x.shape[0], w.shape[0])


@skinny_int8.register_fake
def _(x, w, scales, residual=None, glu=False, pdl=False):
    return x.new_empty(x.shape[0], w.shape[0])


@skinny_int4.register_fake
def _(x, qweight, scales, zeros, group_size, residual=None, glu=False, pdl=False):
    return x.new_empty(x.shape[0], qweight.shape[0])


@skinny_int4_i8.register_fake
def _(x, qweight, scales, zeros, group_size, residual=None, glu=False, pdl=False):
    return x.new_empty(x.shape[0], qweight.shape[0])
