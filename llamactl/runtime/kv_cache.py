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


class LayerCache(nn.Module):
    """One layer's keys and values: k, v [rows, H_kv, max_seq, D], written in place at positions."""

    def __init__(self, rows: int, kv_heads: int, max_seq: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (rows, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def first(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows 0..b-1 (a batch bucket's): k, v [b, H_kv, max_seq, D], views."""
        return (self.k, self.v) if b == self.k.shape[0] else (self.k[:b], self.v[:b])

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot: "int | torch.Tensor | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v at input_pos and return the cache rows attention reads. input_pos: [S] (every
        row at the same positions) or [B, S] (each row at its own); slot: write and read only
        cache row `slot` (k/v: [1, H_kv, S, D]; a sequence joining a running batch), or rows
        slot: [B] (several whole prompts joining at once, at positions 0..S-1: k/v are all their
        cache holds, and are returned as they are)."""
        # k/v: [B, H_kv, S, D] -> the cache rows [B, H_kv, max_seq, D] (rows 0..B-1 where B is fewer)
        if isinstance(slot, torch.Tensor):
            s = k.shape[2]
            self.k[:, :, :s].index_copy_(0, slot, k)  # positions 0..S-1 of each prompt's row
            self.v[:, :, :s].index_copy_(0, slot, v)
            return k, v  # [B, H_kv, S, D]: no gather of what was just written
        if slot is not None:
            ck, cv = self.k[slot : slot + 1], self.v[slot : slot + 1]
        else:
            ck, cv = self.first(k.shape[0])
        if input_pos.dim() == 1:
            ck.index_copy_(2, input_pos, k)
            cv.index_copy_(2, input_pos, v)
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
            ck[rows, :, input_pos] = k.transpose(1, 2)  # [B, S, H_kv, D] at each row's own positions
            cv[rows, :, input_pos] = v.transpose(1, 2)
        return ck, cv


class StaticCache(nn.Module):
    """`rows` sequences of up to `max_seq` positions, for every layer, allocated once. A sequence
    owns a row (its slot) from its prompt to its last token; positions nothing has written hold
    stale values that the causal mask and the decode kernels' lengths never read."""

    def __init__(self, layers: int, rows: int, kv_heads: int, max_seq: int, head_dim: int, dtype, device):
        super().__init__()
        self.rows, self.max_seq, self.dtype = rows, max_seq, dtype
        self.layers = nn.ModuleList(LayerCache(rows, kv_heads, max_seq, head_dim, dtype, device)
                                    for _ in range(layers))

    @classmethod
    def for_model(cls, model, rows: int, max_seq: int, dtype: torch.dtype | None = None) -> "StaticCache":
        """A cache shaped for `model` (a runtime.model.LlamaModel), on its device, in its dtype unless given."""
        a = model.args
        return cls(a.num_hidden_layers, rows, a.num_key_value_heads, max_seq, a.head_dim, dtype or model.dtype,
                   model.device)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: every row, every position, K and V of every layer."""
        return sum(l.k.numel() * l.k.element_size() + l.v.numel() * l.v.element_size() for l in self.layers)

    @property
    def tokens(self) -> int:
        """Positions it holds in all: rows x max_seq."""
        return self.rows * self.max_seq
