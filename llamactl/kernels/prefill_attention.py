"""Prefill attention over a paged KV cache for several sequences packed into one forward ("ragged").

A server's prefill forward packs the new tokens of several sequences one after another (T tokens
in all, no padding): sequence i contributes n_i tokens at positions c_i..c_i+n_i-1 of its own
cache row, whose positions 0..c_i-1 (a cached prefix, earlier chunks) are in the pool already.
Their K/V are written to the pool first (PagedLayer.write_at); this kernel then attends each new
token to its sequence's positions 0..its own, read through the block table. One program per
(tile of BLOCK_M query tokens of one sequence, query head), flash attention's online softmax over
BLOCK_N keys at a time; the tiles are listed on the host (Ragged.tiles), so the grid fits the
batch and no program waits on another sequence's length.

runtime.ragged.reference is the same attention in PyTorch (the CPU's path).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llamactl.kernels.kv_tile import kv8_args, kv8_query, kv8_scales, kv_acc, kv_accumulate, kv_output, kv_scores

BLOCK_N = 64  # keys a loop iteration


@triton.jit
def _pool_at(table_ptr, row, T_ROW, s, ok, hk, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
    """Offsets [BN] of positions s (ok: the ones to read) of the sequence at table row `row`, KV
    head hk, in pools [blocks, BS, HKV, D]."""
    blk = tl.load(table_ptr + row * T_ROW + s // BS, mask=ok, other=0).to(tl.int64)
    return ((blk * BS + s % BS) * HKV + hk) * D


@triton.jit
def _ragged_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, T_ROW, tile_seq_ptr, tile_m_ptr, q_start_ptr, q_len_ptr,
                   ctx_ptr, row_ptr, scale, q_tok, q_head, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                   ks_ptr=None, vs_ptr=None, KV8: tl.constexpr = False, INT8: tl.constexpr = False,
                   QMAX: tl.constexpr = 127.0, ASM: tl.constexpr = False):
    # q: [T, H, D] with q_tok / q_head elements between tokens / heads; o: [T, H, D] contiguous;
    # pools [blocks, BS, HKV, D]; table [rows, T_ROW] int32; per tile: its sequence and first query
    # token (within the sequence); per sequence: its first token in T, its token count, the
    # positions cached before them, its table row; KV8: 8-bit pools with float16 scales
    # [blocks, BS, HKV] (kernels.kv_tile.kv8_args; QMAX unused: nothing is written here), read in
    # float16 dots (ASM: converted by inline PTX)
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    m0 = tl.load(tile_m_ptr + tile)
    qs = tl.load(q_start_ptr + seq).to(tl.int64)
    n = tl.load(q_len_ptr + seq)
    c0 = tl.load(ctx_ptr + seq)
    row = tl.load(row_ptr + seq).to(tl.int64)
    hk = h // (H // HKV)
    m = m0 + tl.arange(0, BLOCK_M)  # [BM] query tokens within the sequence
    ok_m = m < n
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (qs + m)[:, None] * q_tok + h * q_head + d[None, :], mask=ok_m[:, None], other=0.0)
    q, q_factor = kv8_query(q, KV8)
    qpos = c0 + m  # [BM] their positions
    end = c0 + tl.minimum(m0 + BLOCK_M, n)  # keys 0..end-1: the tile's last query's
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc, odd = kv_acc(BLOCK_M, D, KV8)
    s = tl.arange(0, BLOCK_N)  # the first block's positions
    ks, vs = kv8_scales(ks_ptr, vs_ptr, _pool_at(table_ptr, row, T_ROW, s, s < end, hk, HKV, BS, D), s < end, D, KV8)
    for s0 in range(0, end, BLOCK_N):
        s = s0 + tl.arange(0, BLOCK_N)  # [BN]
        ok = s < end
        at = _pool_at(table_ptr, row, T_ROW, s, ok, hk, HKV, BS, D)  # [BN]
        sn = s + BLOCK_N  # the next block's scales, loaded now (kv8_scales)
        ks_next, vs_next = kv8_scales(ks_ptr, vs_ptr, _pool_at(table_ptr, row, T_ROW, sn, sn < end, hk, HKV, BS, D),
                                      sn < end, D, KV8)
        scores = kv_scores(q, k_ptr, ks, at, d, ok, scale * q_factor, PRECISION, KV8, INT8, ASM)  # [BM, BN]
        scores = tl.where(ok[None, :] & (s[None, :] <= qpos[:, None]), scores, float("-inf"))
        m_new = tl.maximum(mx, tl.max(scores, axis=1))  # finite: key 0 is in the first block
        alpha = tl.exp(mx - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc, odd = kv_accumulate(acc, odd, alpha, p, v_ptr, vs, at, d, ok, q.dtype, PRECISION, KV8, INT8, ASM)
        mx = m_new
        ks, vs = ks_next, vs_next
    acc = kv_output(acc, odd, D, KV8)  # [BM, D]
    out = o_ptr + ((qs + m)[:, None] * H + h) * D + d[None, :]
    tl.store(out, (acc / l[:, None]).to(o_ptr.dtype.element_ty), mask=ok_m[:, None])


def ragged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                     ragged, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] (rotated; any strides with D contiguous), pools [blocks, BS, H_kv, D] holding
    every sequence's K/V up to its new tokens' (theirs written), table [rows, M] int32, ragged:
    runtime.ragged.Ragged (its tiles of ragged.tile query tokens) -> [T, H, D], each token
    attending to its sequence's positions up to its own. k_scale/v_scale [blocks, BS, H_kv]: the
    pools hold 8-bit values with these scales (runtime.kv_format)."""
    t, h, d = q.shape
    if d & (d - 1) or d < 16:
        raise ValueError(f"prefill attention needs a power-of-two head_dim >= 16, got {d}")
    # tokens no sequence queries (ragged.padded: a verify step's padding) stay 0, not unset memory
    out = (torch.zeros if ragged.padded else torch.empty)(t, h, d, dtype=q.dtype, device=q.device)
    tiles = ragged.tile_seq.numel()
    if tiles == 0:
        return out
    _ragged_kernel[(tiles, h)](q, k_pool, v_pool, out, table, table.stride(0), ragged.tile_seq, ragged.tile_m,
                               ragged.q_start, ragged.q_len, ragged.ctx, ragged.rows, 1.0 / math.sqrt(d),
                               q.stride(0), q.stride(1), H=h, HKV=k_pool.shape[2], D=d, BS=k_pool.shape[1],
                               BLOCK_M=ragged.tile, BLOCK_N=BLOCK_N,
                               PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2,
                               **kv8_args(k_pool, (k_scale, v_scale)))
    return out

