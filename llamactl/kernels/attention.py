"""Split-KV decode attention in Triton ("flash decoding") over llamactl's static cache.

One new token attends to cache positions 0..pos. SDPA is given the whole preallocated cache and a
mask, so it reads every position up to max_seq, and at batch 1 it has only batch x heads programs
to spread over the chip. Here the cache is cut into SPLITS chunks, one program per (batch, KV head,
chunk); chunks past pos exit at once, so a 16K cache holding 300 tokens costs 300 tokens of reads,
and `pos` is read on the device, so the kernel can sit in a CUDA graph. The query heads of one KV
head (grouped-query attention) are the rows of one tile, so K/V are read once per KV head. A second
kernel merges the chunks' partial softmaxes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MAX_SPLITS = 64
MIN_CHUNK = 64  # short caches: more, shorter programs (launch latency, not bytes, bounds them)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, acc_ptr, ml_ptr, S, scale, R: tl.constexpr,
                  SPLITS: tl.constexpr, CHUNK: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    # q: [BH, R, D], k/v: [BH, S, D], pos: [1]; acc: [BH, SPLITS, BLOCK_R, D] fp32, ml: [BH, SPLITS, 2, BLOCK_R]
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    n_ctx = tl.load(pos_ptr).to(tl.int32) + 1
    start = split * CHUNK
    end = tl.minimum(start + CHUNK, n_ctx)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + bh * R * D + r[:, None] * D + d[None, :], mask=(r < R)[:, None], other=0.0)  # [BR, D]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    kv_base = bh * S * D
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)  # [BS]
        ok = s < end
        k = tl.load(k_ptr + kv_base + s[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)  # [BS, D]
        scores = tl.dot(q, tl.trans(k)) * scale  # [BR, BS]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])  # [BR, BS]
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_base + s[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)  # [BS, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = (bh * SPLITS + split) * BLOCK_R
    tl.store(acc_ptr + (out + r[:, None]) * D + d[None, :], acc)
    tl.store(ml_ptr + (bh * SPLITS + split) * 2 * BLOCK_R + r, m)
    tl.store(ml_ptr + (bh * SPLITS + split) * 2 * BLOCK_R + BLOCK_R + r, l)


@triton.jit
def _merge_kernel(acc_ptr, ml_ptr, o_ptr, R: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    # one program per (bh, query row r): o[bh, r] = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i
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


def plan(max_seq: int) -> tuple[int, int]:
    """(splits, chunk) for a cache of max_seq positions: chunks of at least MIN_CHUNK, at most MAX_SPLITS."""
    splits = max(1, min(MAX_SPLITS, triton.cdiv(max_seq, MIN_CHUNK)))
    splits = triton.next_power_of_2(splits)
    chunk = triton.cdiv(triton.cdiv(max_seq, splits), 64) * 64
    return splits, chunk


@torch.library.custom_op("llamactl::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """q: [B, H_kv, R, D] (R query heads per KV head), k/v: [B, H_kv, S, D], pos: [1] ->
    softmax(q k^T / sqrt(D)) v over cache positions 0..pos, [B, H_kv, R, D]."""
    b, hkv, r, d = q.shape
    s = k.shape[2]
    if d & (d - 1) or d < 16:
        raise ValueError(f"decode_attention needs a power-of-two head_dim >= 16, got {d}")
    splits, chunk = plan(s)
    block_r = max(16, triton.next_power_of_2(r))
    bh = b * hkv
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    acc = torch.empty(bh, splits, block_r, d, dtype=torch.float32, device=q.device)
    ml = torch.empty(bh, splits, 2, block_r, dtype=torch.float32, device=q.device)
    _split_kernel[(bh, splits)](q, k, v, pos, acc, ml, s, 1.0 / math.sqrt(d), R=r, SPLITS=splits, CHUNK=chunk,
                                D=d, BLOCK_R=block_r, BLOCK_S=64, num_warps=4)
    out = torch.empty_like(q)
    _merge_kernel[(bh, r)](acc, ml, out, R=r, SPLITS=splits, D=d, BLOCK_R=block_r, num_warps=4)
    return out


@decode_attention.register_fake
def _(q, k, v, pos):
    return torch.empty_like(q)
