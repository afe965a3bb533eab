"""Several sequences' new tokens packed into one forward over a paged cache, without padding.

A server prefills the prompt chunks of several requests at once: their tokens are laid end to end
as one row of T tokens (`model(ids [1, T], pos [1, T], cache, slot=ragged)`), each token at its own
position of its own cache row, whose earlier positions (a cached prefix, earlier chunks) are in
the pool already. `Ragged` is what the forward needs to know about the packing, on the device,
built once a forward: where each token's K/V go in the pool, each sequence's span, and the tiles
of the prefill attention (kernels.prefill_attention on CUDA, `reference` elsewhere).

The same forward carries the step's decode rows (a "mixed" step): the first `decode` sequences are
one token each, a running row's next token, so the weights are read once for both. On CUDA their
attention is the decode kernel's (kernels.attention.paged_decode_attention, split over the cache),
not a prefill tile of one useful query row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llamactl.runtime.kv_cache import NULL_BLOCK
from llamactl.runtime.kv_format import dequantize
from llamactl.runtime.transfer import lists_to_device

TILE = 64  # query tokens of one sequence an attention program takes


@dataclass
class Ragged:
    """n sequences, T tokens: sequence i's tokens are q_start[i]..q_start[i]+q_len[i]-1 of the
    forward, at positions ctx[i].. of table row rows[i]."""

    rows: torch.Tensor  # [n] int32: table rows
    q_start: torch.Tensor  # [n] int32
    q_len: torch.Tensor  # [n] int32
    ctx: torch.Tensor  # [n] int32: positions cached before its tokens
    tile_seq: torch.Tensor  # [tiles] int32: the sequence of each attention tile
    tile_m: torch.Tensor  # [tiles] int32: its first query token within the sequence
    positions: torch.Tensor  # [1, T] int64: each token's position
    last: torch.Tensor  # [n] int64: each sequence's last token in the forward (every token: [T])
    where: torch.Tensor  # [T] int64: each token's place in the pool (block * block_size + offset)
    token_rows: torch.Tensor  # [T] int64: each token's table row
    decode: int = 0  # the first `decode` sequences are single decode tokens (tiles only for the rest)
    decode_table: torch.Tensor | None = None  # [decode, M] int32: their table rows
    tile: int = TILE
    padded: bool = False  # some tokens no sequence queries (uniform: a verify step's padding, free rows)

    @classmethod
    def build(cls, cache, rows: list[int], starts: list[int], lens: list[int], decode: int = 0,
              every: "bool | list[bool]" = False) -> "Ragged":
        """Sequences of lens[i] new tokens at positions starts[i].. of table rows rows[i] of cache
        (a runtime.kv_cache.PagedCache whose table holds their blocks); the first `decode` of them
        decode rows (one token each). every: the forward gives every token's logits (a verify
        step's), not each sequence's last token's; a list: every token's of the sequences it marks
        (a scored prompt's), the last token's of the others."""
        if (not (len(rows) == len(starts) == len(lens)) or any(n < 1 for n in lens) or any(s < 0 for s in starts)
                or not 0 <= decode <= len(rows) or any(n != 1 for n in lens[:decode])):
            raise ValueError(f"a packed forward of rows {rows}, starts {starts}, lengths {lens}, {decode} decoding")
        q_start, at = [], 0
        for n in lens:
            q_start.append(at)
            at += n
        tiles = [(i, m) for i, n in enumerate(lens) if i >= decode for m in range(0, n, TILE)]
        device = cache.table.device
        i32 = lists_to_device([rows, q_start, lens, starts, [i for i, _ in tiles], [m for _, m in tiles]], device,
                              torch.int32)
        marks = every if isinstance(every, list) else [every] * len(lens)
        positions, token_rows, last = lists_to_device(
            [[s + j for s, n in zip(starts, lens) for j in range(n)],  # [T]
             [r for r, n in zip(rows, lens) for _ in range(n)],  # [T]
             [a + j for a, n, e in zip(q_start, lens, marks) for j in (range(n) if e else [n - 1])]], device, torch.long)
        positions = positions.view(1, -1)  # [1, T]
        table = cache.table[i32[0][:decode].long()] if decode else None  # [decode, M]
        return cls(*i32, positions, last, cache.at(token_rows, positions[0]), token_rows, decode, table)


def uniform(cache, pos: torch.Tensor, lens: torch.Tensor, width: int) -> Ragged:
    """Rows 0..b-1 of cache, `width` tokens each at positions pos[r].. (a verify step's: a row's
    last token and proposals, padded), every token's logits: built on the device from pos [b] and
    lens [b] with no host read, so a CUDA graph captures it. A row's tokens past lens[r] (padding;
    a free row's lens is 0) are no queries of its sequence (their attention output is zeros, their
    draws are dropped), write their K/V into the null block, never a row's own blocks, and sit at
    positions clamped to the cache. (Left unset, a padding token's NaN went on into its K/V of the
    next layers, in the null block, which an eager decode step gathers under its mask: 0 x NaN.)"""
    b, dev = pos.numel(), pos.device
    j = torch.arange(width, device=dev)
    rows = torch.arange(b, dtype=torch.int32, device=dev)
    positions = (pos.view(b, 1) + j).clamp(max=cache.max_seq - 1).view(1, b * width)  # [1, T]
    token_rows = torch.arange(b, device=dev).repeat_interleave(width)  # [T]
    real = (j < lens.view(b, 1)).view(-1)  # [T]
    where = torch.where(real, cache.at(token_rows, positions[0]), NULL_BLOCK * cache.block_size + j.repeat(b)
                        % cache.block_size)  # [T]
    return Ragged(rows, rows * width, lens.to(torch.int32), pos.to(torch.int32), rows,
                  torch.zeros_like(rows), positions, torch.arange(b * width, device=dev), where, token_rows,
                  padded=True)


def attend(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
           ragged: Ragged, min_chunk: int = 64, k_scale: torch.Tensor | None = None,
           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] (rotated), pools [blocks, BS, H_kv, D] holding every sequence's K/V up to its
    new tokens' (theirs written), table [rows, M] int32 -> [T, H, D], each token attending to its
    sequence's positions up to its own: `kernels` on CUDA, else `reference`. k_scale/v_scale
    [blocks, BS, H_kv]: the pools' scales where they hold 8-bit values (runtime.kv_format)."""
    return (kernels(q, k_pool, v_pool, table, ragged, min_chunk, k_scale, v_scale) if q.is_cuda
            else reference(q, k_pool, v_pool, table, ragged, k_scale, v_scale))


def kernels(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
            ragged: Ragged, min_chunk: int = 64, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` in Triton: the prefill kernel for the prompt chunks, the paged decode kernel for
    the decode rows (min_chunk: its smallest split of the cache)."""
    from llamactl.kernels.attention import paged_decode_attention
    from llamactl.kernels.prefill_attention import ragged_attention

    out = ragged_attention(q, k_pool, v_pool, table, ragged, k_scale, v_scale)  # [T, H, D]; the decode rows' left unset
    d, (_, h, dim) = ragged.decode, q.shape
    if d:
        hkv = k_pool.shape[2]
        pos = ragged.ctx[:d].long()  # [d]: each decode token's position
        out[:d] = paged_decode_attention(q[:d].reshape(d, hkv, h // hkv, dim), k_pool, v_pool, ragged.decode_table,
                                         pos, min_chunk, False, k_scale, v_scale).reshape(d, h, dim)
    return out


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
              ragged: Ragged, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`attend` in PyTorch: each sequence's keys gathered through its table row (dequantized
    where 8-bit), SDPA with its causal offset, the query heads of a KV head as more rows of it."""
    t, h, d = q.shape
    hkv, bs = k_pool.shape[2], k_pool.shape[1]
    out = (torch.zeros if ragged.padded else torch.empty)(t, h, d, dtype=q.dtype, device=q.device)  # (padding: zeros)
    flat_k, flat_v = k_pool.flatten(0, 1), v_pool.flatten(0, 1)  # [N*BS, H_kv, D]
    for start, n, c0, row in zip(*(x.tolist() for x in (ragged.q_start, ragged.q_len, ragged.ctx, ragged.rows))):
        if n == 0:  # a free row of a verify step (uniform)
            continue
        pos = torch.arange(c0 + n, device=q.device)
        at = table[row, pos // bs].long() * bs + pos % bs  # [c0 + n]
        k, v = flat_k[at], flat_v[at]  # [c0 + n, H_kv, D]
        if k_scale is not None:
            k = dequantize(k, k_scale.flatten(0, 1)[at], q.dtype)
            v = dequantize(v, v_scale.flatten(0, 1)[at], q.dtype)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [H_kv, c0 + n, D]
        qi = q[start : start + n].transpose(0, 1).reshape(hkv, h // hkv * n, d)  # [H_kv, rep * n, D]
        qpos = (c0 + torch.arange(n, device=q.device)).repeat(h // hkv)  # [rep * n]
        y = F.scaled_dot_product_attention(qi, k, v, attn_mask=pos[None, :] <= qpos[:, None])  # [H_kv, rep * n, D]
        out[start : start + n] = y.reshape(h, n, d).transpose(0, 1)
    return out
