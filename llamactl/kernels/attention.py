"""Split-KV decode attention in Triton ("flash decoding") over llamactl's static cache.

One new token attends to cache positions 0..pos. SDPA is given the whole preallocated cache and a
mask, so it reads every position up to max_seq, and at batch 1 it has only batch x heads programs
to spread over the chip. Here the cache is cut into SPLITS chunks, one program per (batch, KV head,
chunk); chunks past pos exit at once, so a 16K cache holding 300 tokens costs 300 tokens of reads,
and `pos` is read on the device, so the kernel can sit in a CUDA graph. pos is one position for
every row ([1]) or each row's own ([B]: sequences of different lengths, each read to its own). The query heads of one KV
head (grouped-query attention) are the rows of one tile, so K/V are read once per KV head. A second
kernel merges the chunks' partial softmaxes.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from llamactl.kernels.device import index, pdl_launch
from llamactl.kernels.fp8 import e4m3_round, round_half_even
from llamactl.kernels.gdc import wait_for_previous
from llamactl.kernels.kv_tile import (kv8_args, kv8_query, kv8_scales, kv_acc, kv_accumulate,
                                      kv_output, kv_scores)

MAX_SPLITS = 64
MIN_CHUNK = 64  # short caches: more, shorter programs (launch latency, not bytes, bounds them)
# Triton's software-pipelining depth of the split kernel's loop: 2 read a batch's cache 10-11%
# faster than its default 3 (llama2-7b's heads at 8 rows, llama3-8b's at 32) and as fast at 1 row
# and elsewhere; summing in registers instead of tensor-core dots was 1.3-3.9x slower
# (scripts/attention_probe.py, docs/bench/README.md, 2026-12-04)
STAGES = 2
# An 8-bit cache's tiles are half the bytes: a third stage keeps as many in flight. 3 read int8 K/V
# 4-6% faster than 2 (llama2-7b at 1 row and 16K positions: 65.7 against 69.5 us; llama3-8b at 32
# rows and 4K: 118.4 against 123.3; wider tiles and 8 warps slower), H100,
# docs/bench/runs/2026-12-07-kv8-fp8-json-h100
KV8_STAGES = 3


@triton.jit
def _rope(ptr, rows, d, cos, sin, mask, D: tl.constexpr):
    """Rows of ptr ([rows, D]) rotated as HF's apply_rope does: x * cos + rotate_half(x) * sin, float32."""
    x = tl.load(ptr + rows[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptr + rows[:, None] * D + ((d + D // 2) % D)[None, :], mask=mask, other=0.0).to(tl.float32)
    sign = tl.where(d < D // 2, -1.0, 1.0)  # rotate_half: (-x2, x1)
    return x * cos[None, :] + sign[None, :] * partner * sin[None, :]


@triton.jit
def _store_kv(ptr, scale_ptr, at, x, d, KV8: tl.constexpr, INT8: tl.constexpr, QMAX: tl.constexpr):
    """One position's vector x [1, D] (float32) into a cache at offset at: as it is, or (KV8) as 8
    bits and a float16 scale (its largest magnitude over QMAX, at scale_ptr + at // D), as
    runtime.kv_format.quantize does."""
    if KV8:
        amax = tl.max(tl.abs(x), axis=1)  # [1]
        sc = tl.minimum(tl.maximum(amax / QMAX, 2.0**-24), 65504.0).to(tl.float16)
        y = x / sc.to(tl.float32)[:, None]
        if INT8:
            y = tl.minimum(tl.maximum(round_half_even(y), -127.0), 127.0)
        else:
            y = e4m3_round(tl.minimum(tl.maximum(y, -QMAX), QMAX))
        tl.store(ptr + at + d[None, :], y.to(ptr.dtype.element_ty))
        tl.store(scale_ptr + at // d.shape[0] + tl.arange(0, 1), sc)
    else:
        tl.store(ptr + at + d[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _at(s, ok, b, h, table_ptr, T_ROW, D: tl.constexpr, HKV: tl.constexpr, BS: tl.constexpr, PAGED: tl.constexpr):
    """Offsets [BLOCK_S] of positions s (ok: the ones to read) of row b, KV head h: s * D in a
    contiguous [BH, S, D] cache (past the row's base), or through the block table in a pool
    [blocks, BS, HKV, D]."""
    if PAGED:
        blk = tl.load(table_ptr + b * T_ROW + s // BS, mask=ok, other=0).to(tl.int64)
        return ((blk * BS + s % BS) * HKV + h) * D
    return s.to(tl.int64) * D


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, ml_ptr, o_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, S, scale,
                  q_row, kn_row, vn_row, R: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, ROPE: tl.constexpr, PRECISION: tl.constexpr,
                  HKV: tl.constexpr = 1, ROW_POS: tl.constexpr = False, PDL: tl.constexpr = False,
                  table_ptr=None, T_ROW=0, PAGED: tl.constexpr = False, BS: tl.constexpr = 16,
                  ROW_CHUNKS: tl.constexpr = False, ks_ptr=None, vs_ptr=None, KV8: tl.constexpr = False,
                  INT8: tl.constexpr = False, QMAX: tl.constexpr = 127.0, ASM: tl.constexpr = False):
    # q: [B, HKV, R, D] with q_row elements from one row b to the next (a slice of the fused qkv
    # projection's output: no copy), k/v: [BH, S, D], pos: [1], or [B] with ROW_POS (row b = bh // HKV
    # at its own; cos/sin then [B, D]); acc: [BH, SPLITS, BLOCK_R, D] fp32, ml: [BH, SPLITS, 2, BLOCK_R];
    # one split (SPLITS == 1): the program holds the whole softmax and stores o: [BH, R, D] itself (no merge kernel)
    # ROPE: q and the new key kn: [B, HKV, D] (kn_row apart) are rotated here (cos/sin: [D] at pos),
    # and the program whose chunk holds pos writes the new key and value vn ([B, HKV, D], vn_row
    # apart) into the cache first.
    # PRECISION: "ieee" for float32 caches (tl.dot would round them to TF32), "tf32" otherwise (no effect)
    # PDL (programmatic dependent launch, see kernels.pdl): wait for the previous kernel first
    # PAGED: k/v are a pool [blocks, BS, HKV, D]; row b's position s is at block table[b, s // BS]
    # (table: [B, T_ROW] int32), offset s % BS
    # ROW_CHUNKS: each row's own positions 0..pos cut into SPLITS chunks (whole tiles), not the
    # cache's capacity into chunks of CHUNK: every split of a short row in a long table has work
    # KV8: the caches hold 8-bit values (INT8: int8, else fp8 e4m3; QMAX their largest magnitude)
    # with a float16 scale per position and head (ks/vs: [BH, S] or [blocks, BS, HKV], the
    # element at a value's offset // D); the new key and value are written so (kernels read both
    # alike, runtime.kv_format), read in float16 dots (kv8_query; ASM: converted by inline PTX)
    wait_for_previous(PDL)
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    row = b if ROW_POS else 0
    pos = tl.load(pos_ptr + row).to(tl.int32)
    q_at = q_ptr + b * q_row + h * R * D  # this KV head's query rows [R, D]
    n_ctx = pos + 1
    chunk = CHUNK
    if ROW_CHUNKS:
        chunk = tl.cdiv(tl.cdiv(n_ctx, SPLITS), BLOCK_S) * BLOCK_S
    start = split * chunk
    end = tl.minimum(start + chunk, n_ctx)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    kv_base = bh * S * D
    if PAGED:  # the address of position s is _paged(...) + d; kv_base unused
        kv_base = 0
    if ROPE:
        cos = tl.load(cos_ptr + row * D + d)
        sin = tl.load(sin_ptr + row * D + d)
        q = _rope(q_at, r, d, cos, sin, (r < R)[:, None], D).to(q_ptr.dtype.element_ty)  # [BR, D]
        if pos // chunk == split:  # only this program reads position pos: no other program races it
            one = tl.arange(0, 1)
            k_new = _rope(kn_ptr + b * kn_row + h * D, one, d, cos, sin, (one < 1)[:, None], D)  # [1, D]
            v_new = tl.load(vn_ptr + b * vn_row + h * D + one[:, None] * 0 + d[None, :]).to(tl.float32)
            if PAGED:  # position pos's row in the pool
                blk = tl.load(table_ptr + b * T_ROW + pos // BS).to(tl.int64)
                at = ((blk * BS + pos % BS) * HKV + h) * D
            else:
                at = kv_base + pos * D
            _store_kv(k_ptr, ks_ptr, at, k_new, d, KV8, INT8, QMAX)
            _store_kv(v_ptr, vs_ptr, at, v_new, d, KV8, INT8, QMAX)
            tl.debug_barrier()  # the writes above are visible to the whole program before the loop reads them
    else:
        q = tl.load(q_at + r[:, None] * D + d[None, :], mask=(r < R)[:, None], other=0.0)  # [BR, D]
    q, q_factor = kv8_query(q, KV8)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc, odd = kv_acc(BLOCK_R, D, KV8)
    s = start + tl.arange(0, BLOCK_S)  # [BS] the first tile's positions
    ks, vs = kv8_scales(ks_ptr, vs_ptr, kv_base + _at(s, s < end, b, h, table_ptr, T_ROW, D, HKV, BS, PAGED), s < end,
                        D, KV8)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BS]
        ok = s < end
        at = kv_base + _at(s, ok, b, h, table_ptr, T_ROW, D, HKV, BS, PAGED)  # [BS] row offsets
        # the next tile's scales, loaded now; its offsets are computed again next tile, not carried:
        # Triton's pipeliner then no longer prefetches K/V with async copies (SASS, 2026-12-08)
        sn = s + BLOCK_S
        ks_next, vs_next = kv8_scales(ks_ptr, vs_ptr, kv_base + _at(sn, sn < end, b, h, table_ptr, T_ROW, D, HKV, BS,
                                                                    PAGED), sn < end, D, KV8)
        scores = kv_scores(q, k_ptr, ks, at, d, ok, scale * q_factor, PRECISION, KV8, INT8, ASM)  # [BR, BS]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])  # [BR, BS]
        l = l * alpha + tl.sum(p, axis=1)
        acc, odd = kv_accumulate(acc, odd, alpha, p, v_ptr, vs, at, d, ok, q.dtype, PRECISION, KV8, INT8, ASM)
        m = m_new
        ks, vs = ks_next, vs_next
    acc = kv_output(acc, odd, D, KV8)  # [BR, D]
    if SPLITS == 1:  # position 0 is in this chunk: l > 0
        tl.store(o_ptr + (bh * R + r[:, None]) * D + d[None, :], (acc / l[:, None]).to(o_ptr.dtype.element_ty),
                 mask=(r < R)[:, None])
        return
    out = (bh * SPLITS + split) * BLOCK_R
    tl.store(acc_ptr + (out + r[:, None]) * D + d[None, :], acc, mask=(r < R)[:, None])  # the tile's real rows
    tl.store(ml_ptr + (bh * SPLITS + split) * 2 * BLOCK_R + r, m, mask=r < R)
    tl.store(ml_ptr + (bh * SPLITS + split) * 2 * BLOCK_R + BLOCK_R + r, l, mask=r < R)


@triton.jit
def _merge_kernel(acc_ptr, ml_ptr, o_ptr, R: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr,
                  BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    # one program per (bh, query row r): o[bh, r] = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i
    wait_for_previous(PDL)
    bh = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    i = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    base = (bh * SPLITS + i) * 2 * BLOCK_R + r  # [SPLITS]
    m = tl.load(ml_ptr + base)
    l = tl.load(ml_ptr + base + BLOCK_R)
    m_max = tl.max(m, axis=0)  # split 0 always holds position 0, so this is finite
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)  # [SPLITS]
    acc = tl.load(acc_ptr + ((bh * SPLITS + i) * BLOCK_R + r)[:, None] * D + d[None, :])  # [SPLITS, D]
    o = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(o_ptr + (bh * R + r) * D + d, o.to(o_ptr.dtype.element_ty))


def label(min_chunk: int = MIN_CHUNK) -> str:
    """The decode attention in reports, with the smallest chunk where it is not the default."""
    return "triton split-kv" + (f", min chunk {min_chunk}" if min_chunk != MIN_CHUNK else "")


def plan(max_seq: int, min_chunk: int = MIN_CHUNK, heads: int = 1, fill: int = 0) -> tuple[int, int]:
    """(splits, chunk) for a cache of max_seq positions: chunks of at least min_chunk positions
    (a multiple of it), at most MAX_SPLITS of them, a power of two; and no more of them than
    keep heads x splits >= fill programs (heads: rows x KV heads; fill: programs that fill the
    GPU, 0: no limit). Many rows need no splits to fill the GPU, and each split costs its
    partial results' writes, the merge's reads and a short program: at 32 rows of llama2-7b
    the split kernel read its cache at 1.9 TB/s with 8 splits (docs/bench/README.md)."""
    splits = max(1, min(MAX_SPLITS, triton.cdiv(max_seq, min_chunk)))
    splits = triton.next_power_of_2(splits)
    while fill and splits > 1 and heads * (splits // 2) >= fill:
        splits //= 2
    chunk = triton.cdiv(triton.cdiv(max_seq, splits), min_chunk) * min_chunk
    return splits, chunk


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t [B, ...] -> (t, elements from one row to the next): as it is where each row is contiguous
    (a batch's slice of the fused qkv projection, rows 3 heads' widths apart), else a contiguous copy."""
    if t.shape[0] > 1 and t[0].is_contiguous() and t.stride(0) >= t[0].numel():
        return t, t.stride(0)
    t = t.contiguous()
    return t, t[0].numel() if t.shape[0] else 0


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
            rope: tuple[torch.Tensor, ...] | None, min_chunk: int = MIN_CHUNK, block_s: int = 64,
            warps: int = 4, pdl: bool = False, stages: int | None = None, table: torch.Tensor | None = None,
            scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
    """Launch the split and merge kernels (the split kernel alone where the plan has one split);
    rope: (k_new, v_new, cos, sin) to fold RoPE and the cache write in, or None. q, k_new and v_new
    are read where they are when each row of them is contiguous (slices of the fused qkv output),
    else copied; cos and sin must be contiguous; the caches are used in place. min_chunk (a chunk at least as long
    as the cache means one split: one kernel a layer, no merge), block_s (positions a tile) and
    warps and stages (the loop's software pipelining; None: STAGES, KV8_STAGES for an 8-bit cache):
    the launch plan; pdl: programmatic dependent launch; scales: an 8-bit cache's (k_scale, v_scale),
    the caches' shape less D (runtime.kv_format)."""
    b, hkv, r, d = q.shape
    stages = stages or (STAGES if scales[0] is None else KV8_STAGES)
    s = k_cache.shape[2] if table is None else table.shape[1] * k_cache.shape[1]  # positions a row may hold
    _check_head_dim(d)
    bh = b * hkv
    fill = _fill(q.device) if table is None else _fill(q.device) * PAGED_FILL_PER_SM // FILL_PER_SM
    splits, chunk = plan(s, min_chunk, bh, fill)
    block_r = max(16, triton.next_power_of_2(r))
    acc = torch.empty(bh, splits, block_r, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bh, splits, 2, block_r, dtype=torch.float32, device=q.device)
    q, q_row = _rows(q)
    k_new, v_new, cos, sin = rope or (q, q, q, q)  # unused without ROPE
    (k_new, kn_row), (v_new, vn_row) = _rows(k_new), _rows(v_new)
    launch = pdl_launch(pdl)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    row_pos = pos.numel() > 1  # one position per row (with one row, the same thing)
    if row_pos and pos.numel() != b:
        raise ValueError(f"decode attention: {pos.numel()} positions for {b} rows")
    _split_kernel[(bh, splits)](q, k_cache, v_cache, pos, acc, ml, out, k_new, v_new, cos, sin, s, 1.0 / math.sqrt(d),
                                q_row, kn_row, vn_row, R=r, SPLITS=splits, CHUNK=chunk, D=d, BLOCK_R=block_r, BLOCK_S=block_s,
                                ROPE=rope is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                                HKV=hkv, ROW_POS=row_pos, num_warps=warps, num_stages=stages,
                                table_ptr=table, T_ROW=0 if table is None else table.stride(0), PAGED=table is not None,
                                BS=16 if table is None else k_cache.shape[1],
                                ROW_CHUNKS=table is not None and PAGED_ROW_CHUNKS, **kv8_args(k_cache, scales), **launch)
    if splits > 1:
        _merge_kernel[(bh, r)](acc, ml, out, R=r, SPLITS=splits, D=d, BLOCK_R=block_r, num_warps=4, **launch)
    return out


@torch.library.custom_op("llamactl::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, min_chunk: int = MIN_CHUNK,
                     pdl: bool = False, k_scale: Optional[torch.Tensor] = None,
                     v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: [B, H_kv, R, D] (R query heads per KV head), k/v: [B, H_kv, S, D], pos: [1] (every row) or
    [B] (each row's own) -> softmax(q k^T / sqrt(D)) v over cache positions 0..pos, [B, H_kv, R, D].
    k_scale/v_scale [B, H_kv, S]: k/v hold 8-bit values with these scales (runtime.kv_format)."""
    scales = (None, None) if k_scale is None else (k_scale.contiguous(), v_scale.contiguous())
    return _attend(q, k.contiguous(), v.contiguous(), pos, None, min_chunk, pdl=pdl, scales=scales)


@decode_attention.register_fake
def _(q, k, v, pos, min_chunk=MIN_CHUNK, pdl=False, k_scale=None, v_scale=None):
    return torch.empty_like(q)


# The ops that write their arguments take no defaults (the public functions below them do):
# torch 2.11's custom ops index the mutated arguments in the call as passed, without its trailing
# defaults (an IndexError on the GPU).
@torch.library.custom_op("llamactl::decode_attention_rope", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def _decode_attention_rope(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                           min_chunk: int, pdl: bool, k_scale: Optional[torch.Tensor],
                           v_scale: Optional[torch.Tensor]) -> torch.Tensor:
    rope = (k_new, v_new, cos.float().contiguous(), sin.float().contiguous())
    return _attend(q, k_cache, v_cache, pos, rope, min_chunk, pdl=pdl, scales=(k_scale, v_scale))


@_decode_attention_rope.register_fake
def _(q, k_new, v_new, k_cache, v_cache, cos, sin, pos, min_chunk, pdl, k_scale, v_scale):
    return torch.empty_like(q)


def decode_attention_rope(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                          min_chunk: int = MIN_CHUNK, pdl: bool = False, k_scale: Optional[torch.Tensor] = None,
                          v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode step's attention with RoPE and the cache write folded in: q: [B, H_kv, R, D] and
    k_new/v_new: [B, H_kv, D] before RoPE, caches [B, H_kv, S, D] (k_new rotated and v_new written at
    pos), cos/sin: [D] float32 at pos: [1], or [B, D] at each row's pos: [B] -> [B, H_kv, R, D]. One
    kernel instead of RoPE, two cache writes and the attention. k_scale/v_scale: an 8-bit cache's
    scales [B, H_kv, S] (the new key and value are quantized into it)."""
    return _decode_attention_rope(q, k_new, v_new, k_cache, v_cache, cos, sin, pos, min_chunk, pdl, k_scale, v_scale)


@torch.library.custom_op("llamactl::paged_decode_attention", mutates_args=())
def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           pos: torch.Tensor, min_chunk: int = MIN_CHUNK, pdl: bool = False,
                           k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: [B, H_kv, R, D], pools [blocks, block_size, H_kv, D], table: [B, M] int32 (row b's
    blocks), pos: [B] -> attention over each row's positions 0..pos[b], [B, H_kv, R, D].
    k_scale/v_scale [blocks, block_size, H_kv]: 8-bit pools' scales."""
    return _attend(q, k_pool, v_pool, pos, None, min_chunk, pdl=pdl, table=table, scales=(k_scale, v_scale))


@paged_decode_attention.register_fake
def _(q, k_pool, v_pool, table, pos, min_chunk=MIN_CHUNK, pdl=False, k_scale=None, v_scale=None):
    return torch.empty_like(q)


@torch.library.custom_op("llamactl::paged_decode_attention_rope", mutates_args=("k_pool", "v_pool", "k_scale", "v_scale"))
def _paged_decode_attention_rope(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                                 v_pool: torch.Tensor, table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 pos: torch.Tensor, min_chunk: int, pdl: bool, k_scale: Optional[torch.Tensor],
                                 v_scale: Optional[torch.Tensor]) -> torch.Tensor:
    rope = (k_new, v_new, cos.float().contiguous(), sin.float().contiguous())
    return _attend(q, k_pool, v_pool, pos, rope, min_chunk, pdl=pdl, table=table, scales=(k_scale, v_scale))


@_paged_decode_attention_rope.register_fake
def _(q, k_new, v_new, k_pool, v_pool, table, cos, sin, pos, min_chunk, pdl, k_scale, v_scale):
    return torch.empty_like(q)


def paged_decode_attention_rope(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_pool: torch.Tensor,
                                v_pool: torch.Tensor, table: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                pos: torch.Tensor, min_chunk: int = MIN_CHUNK, pdl: bool = False,
                                k_scale: Optional[torch.Tensor] = None,
                                v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """decode_attention_rope over a paged pool: k_new rotated and v_new written at row b's
    position pos[b] (its block from table [B, M]), cos/sin [B, D] -> [B, H_kv, R, D]."""
    return _paged_decode_attention_rope(q, k_new, v_new, k_pool, v_pool, table, cos, sin, pos, min_chunk, pdl,
                                        k_scale, v_scale)


FILL_PER_SM = 4  # split-kernel programs a streaming multiprocessor should have to choose from
# The paged cache (a server's steps): a table as wide as --max-seq holds rows of any length. With
# PAGED_ROW_CHUNKS the splits cut each row's own positions, not the table's capacity, and a plan
# splits only while the rows alone give fewer than PAGED_FILL_PER_SM programs an SM (each split
# costs the merge kernel: 1.0 of a 6.6 ms step of 64 rows at 2 splits on an H200). Off (the plan
# measured so far) until scripts/paged_step_probe.py --variants new,old measures it on a GPU:
# docs/decisions/2026-12-06-packed-prefill.md
PAGED_ROW_CHUNKS = False
PAGED_FILL_PER_SM = FILL_PER_SM


def _fill(device: torch.device) -> int:
    """Programs that fill the GPU (FILL_PER_SM a streaming multiprocessor); 0 (no limit) elsewhere."""
    if device.type != "cuda":
        return 0
    return FILL_PER_SM * _sms(index(device))


@functools.lru_cache(maxsize=None)
def _sms(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def _check_head_dim(d: int) -> None:
    if d & (d - 1) or d < 16:
        raise ValueError(f"decode attention needs a power-of-two head_dim >= 16, got {d}")
