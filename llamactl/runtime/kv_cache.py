"""The KV cache as an object handed to the model: the attention writes and reads K/V through it.

The model holds no cache (runtime.model): whoever runs steps owns one (runtime.step.Decoder, a
server's runner, a caller scoring windows) and passes it to `model(ids, pos, cache)`; with no cache
the model attends over its input alone (a whole sequence from position 0: scoring, calibration).
Layer i of the model calls `cache.layers[i].update(...)` with its new keys and values and attends
over what that returns, or hands the layer's tensors to a decode kernel that writes and reads them
itself. A cache of another layout (blocks of a pool, 8-bit values) implements the same two calls.
"""

from __future__ import annotations

import torch
from torch import nn

from llamactl.runtime.kv_format import SCALE_DTYPE, KVFormat, dequantize, quantize
from llamactl.runtime.transfer import to_device


class LayerCache(nn.Module):
    """One layer's keys and values: k, v [rows, H_kv, max_seq, D] in the format's storage dtype
    (runtime.kv_format), written in place at positions; an 8-bit format's scales k_scale, v_scale
    [rows, H_kv, max_seq] float16 beside them (else None)."""

    def __init__(self, rows: int, kv_heads: int, max_seq: int, head_dim: int, dtype, device,
                 fmt: KVFormat | None = None):
        super().__init__()
        self.fmt, self.dtype = fmt or KVFormat.of(dtype), dtype  # dtype: what attention computes in
        _buffers(self, (rows, kv_heads, max_seq, head_dim), self.fmt, device)

    def first(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows 0..b-1 (a batch bucket's): k, v [b, H_kv, max_seq, D], views."""
        return (self.k, self.v) if b == self.k.shape[0] else (self.k[:b], self.v[:b])

    def first_scales(self, b: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The scales of rows 0..b-1 [b, H_kv, max_seq] (None, None in a 16-bit cache)."""
        if self.k_scale is None:
            return None, None
        return (self.k_scale, self.v_scale) if b == self.k.shape[0] else (self.k_scale[:b], self.v_scale[:b])

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot: "int | torch.Tensor | None" = None, span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v at input_pos and return the cache rows attention reads. input_pos: [S] (every
        row at the same positions) or [B, S] (each row at its own); slot: write and read only
        cache row `slot` (k/v: [1, H_kv, S, D]; a sequence joining a running batch), or rows
        slot: [B] (several whole prompts joining at once, at positions 0..S-1: k/v are all their
        cache holds, and are returned as they are). An 8-bit cache returns its positions
        0..span-1 (the mask's width) dequantized."""
        # k/v: [B, H_kv, S, D] -> the cache rows [B, H_kv, max_seq, D] (rows 0..B-1 where B is fewer)
        self.write(input_pos, k, v, slot)
        if isinstance(slot, torch.Tensor):
            return k, v  # [B, H_kv, S, D]: no gather of what was just written
        ck, cv = (self.k[slot : slot + 1], self.v[slot : slot + 1]) if slot is not None else self.first(k.shape[0])
        if self.k_scale is None:
            return ck, cv
        rows = slice(slot, slot + 1) if slot is not None else slice(0, k.shape[0])
        span = span or ck.shape[2]
        return (dequantize(ck[:, :, :span], self.k_scale[rows, :, :span], self.dtype),
                dequantize(cv[:, :, :span], self.v_scale[rows, :, :span], self.dtype))  # [B, H_kv, span, D]

    def write(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot: "int | torch.Tensor | None" = None) -> None:
        """Write k/v [B, H_kv, S, D] at input_pos of the rows `slot`, as update does."""
        for buf, x in _stored(self, k, v):  # values [.., D] and an 8-bit cache's scales [..]
            if isinstance(slot, torch.Tensor):
                buf[:, :, : x.shape[2]].index_copy_(0, slot, x)  # positions 0..S-1 of each prompt's row
                continue
            rows = buf[slot : slot + 1] if slot is not None else buf[: x.shape[0]]
            if input_pos.dim() == 1:
                rows.index_copy_(2, input_pos, x)
            else:
                at = torch.arange(x.shape[0], device=x.device)[:, None]  # [B, 1]
                rows[at, :, input_pos] = x.transpose(1, 2)  # [B, S, H_kv(, D)] at each row's own positions


def _buffers(layer: nn.Module, shape: tuple[int, ...], fmt: KVFormat, device) -> None:
    """k, v of `shape` in fmt's storage dtype, and an 8-bit format's scales (shape less D) as
    k_scale, v_scale (else None): buffers of layer."""
    for name in ("k", "v"):
        layer.register_buffer(name, torch.zeros(shape, dtype=fmt.storage, device=device), persistent=False)
        scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if fmt.quantized else None
        layer.register_buffer(f"{name}_scale", scale, persistent=False)


def _stored(layer: nn.Module, k: torch.Tensor, v: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(buffer, what goes in it) for new k/v [..., D]: themselves, or their 8-bit values and scales."""
    if layer.k_scale is None:
        return [(layer.k, k), (layer.v, v)]
    (qk, sk), (qv, sv) = quantize(k, layer.fmt), quantize(v, layer.fmt)
    if qk.dtype.is_floating_point:  # fp8: PyTorch's index_copy_ and index_put_ have no such kernels; the bytes as they are
        return [(layer.k.view(torch.uint8), qk.view(torch.uint8)), (layer.v.view(torch.uint8), qv.view(torch.uint8)),
                (layer.k_scale, sk), (layer.v_scale, sv)]
    return [(layer.k, qk), (layer.v, qv), (layer.k_scale, sk), (layer.v_scale, sv)]


class StaticCache(nn.Module):
    """`rows` sequences of up to `max_seq` positions, for every layer, allocated once. A sequence
    owns a row (its slot) from its prompt to its last token; positions nothing has written hold
    stale values that the causal mask and the decode kernels' lengths never read."""

    def __init__(self, layers: int, rows: int, kv_heads: int, max_seq: int, head_dim: int, dtype, device,
                 fmt: KVFormat | None = None):
        super().__init__()
        self.rows, self.max_seq, self.dtype = rows, max_seq, dtype
        self.fmt = fmt or KVFormat.of(dtype)
        self.layers = nn.ModuleList(LayerCache(rows, kv_heads, max_seq, head_dim, dtype, device, self.fmt)
                                    for _ in range(layers))

    @classmethod
    def for_model(cls, model, rows: int, max_seq: int, dtype: torch.dtype | None = None,
                  fmt: KVFormat | None = None) -> "StaticCache":
        """A cache shaped for `model` (a runtime.model.LlamaModel), on its device, in its dtype
        unless given, storing fmt (runtime.kv_format; default: that dtype)."""
        a = model.args
        return cls(a.num_hidden_layers, rows, a.num_key_value_heads, max_seq, a.head_dim, dtype or model.dtype,
                   model.device, fmt)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: every row, every position, K and V of every layer."""
        return _nbytes(self.layers)

    @property
    def tokens(self) -> int:
        """Positions it holds in all: rows x max_seq."""
        return self.rows * self.max_seq


def _nbytes(layers) -> int:
    """K and V bytes of every layer of a cache, an 8-bit cache's scales included."""
    return sum(t.numel() * t.element_size() for l in layers for t in (l.k, l.v, l.k_scale, l.v_scale)
               if t is not None)


NULL_BLOCK = 0  # never handed to a sequence: free rows and table entries past a sequence's blocks point here


class PagedLayer(nn.Module):
    """One layer's keys and values in fixed-size blocks of one pool: k, v [blocks, block_size,
    H_kv, D] (an 8-bit format's scales k_scale, v_scale [blocks, block_size, H_kv]). Which blocks
    hold a sequence is its row of the owner's block table."""

    def __init__(self, owner: "PagedCache", blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype, device,
                 fmt: KVFormat | None = None):
        super().__init__()
        self._owner = [owner]  # a list: not a submodule
        self.fmt, self.dtype = fmt or KVFormat.of(dtype), dtype
        _buffers(self, (blocks, block_size, kv_heads, head_dim), self.fmt, device)

    @property
    def owner(self) -> "PagedCache":
        return self._owner[0]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot: "int | torch.Tensor | None" = None, span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, H_kv, S, D] at input_pos ([S] or [B, S]) of the rows `slot` (an int: one
        row, [B]: whole prompts at 0..S-1, None: rows 0..B-1) and return what attention reads:
        k/v themselves for whole prompts, else each row's positions 0..span-1 gathered
        [B, H_kv, span, D] (span: the mask's width; positions past a row's own hold garbage the
        mask hides)."""
        table = self.write(input_pos, k, v, slot)
        if isinstance(slot, torch.Tensor):
            return k, v
        b, span = k.shape[0], span or self.owner.max_seq
        at = self.owner.slots(table, torch.arange(span, device=k.device).expand(b, span))  # [B, span]
        k, v = self.k.flatten(0, 1)[at], self.v.flatten(0, 1)[at]  # [B, span, H_kv, D]
        if self.k_scale is not None:
            k = dequantize(k, self.k_scale.flatten(0, 1)[at], self.dtype)
            v = dequantize(v, self.v_scale.flatten(0, 1)[at], self.dtype)
        return k.transpose(1, 2), v.transpose(1, 2)  # [B, H_kv, span, D]

    def write(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              slot: "int | torch.Tensor | None" = None) -> torch.Tensor:
        """Write k/v [B, H_kv, S, D] at input_pos of the rows `slot` (as update); returns their table rows [B, M]."""
        b, _, s, _ = k.shape
        table = self.owner.rows(slot, b)  # [B, M]
        where = self.owner.slots(table, input_pos.expand(b, s) if input_pos.dim() == 1 else input_pos)  # [B, S]
        self.write_at(where.reshape(-1), k.transpose(1, 2).reshape(b * s, *k.shape[1::2]),
                      v.transpose(1, 2).reshape(b * s, *v.shape[1::2]))  # [B*S, H_kv, D]
        return table


    def write_at(self, where: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, H_kv, D] into pool positions where [T] (PagedCache.at: a packed forward's tokens)."""
        for buf, x in _stored(self, k, v):
            buf.flatten(0, 1).index_copy_(0, where, x)


class PagedCache(nn.Module):
    """K/V of every layer in one pool of `blocks` blocks of `block_size` positions, and a block
    table [rows, max_seq / block_size] of int32 block ids, one row per sequence being served (a
    batch row). Whoever schedules hands out blocks (serve.blocks) and writes the table (set_rows,
    move); attention writes and reads through it. Block NULL_BLOCK is never a sequence's."""

    def __init__(self, layers: int, rows: int, blocks: int, block_size: int, max_seq: int, kv_heads: int,
                 head_dim: int, dtype, device, fmt: KVFormat | None = None):
        super().__init__()
        if blocks < 2 or block_size < 1 or max_seq < 1:
            raise ValueError(f"a paged cache needs 2+ blocks of 1+ positions, not {blocks} of {block_size}")
        self.blocks, self.block_size, self.dtype = blocks, block_size, dtype
        self.fmt = fmt or KVFormat.of(dtype)
        self.width = -(-max_seq // block_size)  # table entries a row
        self.max_seq = self.width * block_size
        self.register_buffer("table", torch.full((rows, self.width), NULL_BLOCK, dtype=torch.int32, device=device),
                             persistent=False)
        self.layers = nn.ModuleList(PagedLayer(self, blocks, block_size, kv_heads, head_dim, dtype, device, self.fmt)
                                    for _ in range(layers))

    @classmethod
    def for_model(cls, model, rows: int, blocks: int, block_size: int, max_seq: int,
                  dtype: torch.dtype | None = None, fmt: KVFormat | None = None) -> "PagedCache":
        a = model.args
        return cls(a.num_hidden_layers, rows, blocks, block_size, max_seq, a.num_key_value_heads, a.head_dim,
                   dtype or model.dtype, model.device, fmt)

    @staticmethod
    def block_bytes(model, block_size: int, fmt: KVFormat | None = None) -> int:
        """Bytes one block takes over all layers, K and V (and an 8-bit format's scales)."""
        a = model.args
        fmt = fmt or KVFormat.of(model.dtype)
        return 2 * a.num_hidden_layers * block_size * a.num_key_value_heads * fmt.bytes_per_head(a.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: every block, K and V of every layer."""
        return _nbytes(self.layers)

    @property
    def tokens(self) -> int:
        """Positions the pool holds (the null block's not counted)."""
        return (self.blocks - 1) * self.block_size

    def rows(self, slot: "int | torch.Tensor | None", b: int) -> torch.Tensor:
        """The table rows of a forward's B rows: [B, M]."""
        if slot is None:
            return self.table[:b]
        if isinstance(slot, torch.Tensor):
            return self.table[slot]
        return self.table[slot : slot + 1]

    def slots(self, table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """table [B, M], pos [B, S] -> the pool positions (block * block_size + offset) [B, S], int64."""
        blk = table.gather(1, (pos // self.block_size).clamp(max=self.width - 1)).long()
        return blk * self.block_size + pos % self.block_size

    def at(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """rows [T] (table rows), pos [T] -> the pool positions of those rows' positions [T], int64."""
        blk = self.table[rows, (pos // self.block_size).clamp(max=self.width - 1)].long()
        return blk * self.block_size + pos % self.block_size

    def set_rows(self, rows: list[int], blocks: list[list[int]]) -> None:
        """Table rows `rows` hold these blocks (then NULL_BLOCK)."""
        host = torch.full((len(rows), self.width), NULL_BLOCK, dtype=torch.int32)
        for i, ids in enumerate(blocks):
            host[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.table[to_device(rows, self.table.device, torch.long)] = to_device(host, self.table.device)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows src's tables ([n] row indexes on the table's device) to rows dst (src's left as they
        are: set_rows frees them)."""
        self.table[dst] = self.table[src]
