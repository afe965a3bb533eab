"""Low-bit embedding tables: the token embedding [V, D] stored as a GPTQ linear of D inputs and V
outputs (the head's own layout), groups along each embedding row.

A lookup unpacks only the rows (packed columns) it reads. A tied model keeps one copy: its head is a
GPTQLinear over the same tensors (LlamaModel.tie_weights), which the 4- and 8-bit kernels then take
like any other layer. The checkpoint names are those of a GPTQ layer, under model.embed_tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from llamactl.layers.gptq import GPTQLinear, gptq_buffers, unpack_rows

EMBED_BITS = (4, 8, 16)  # what --embed-bits takes (16: the table stays as it is)


class QuantEmbedding(nn.Module):
    """nn.Embedding's forward over a GPTQ-packed table (buffers as GPTQLinear(D, V) names them)."""

    def __init__(self, vocab: int, dim: int, bits: int, group_size: int, v1: bool = True):
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"{bits}-bit embeddings: 4 or 8")
        self.num_embeddings, self.embedding_dim, self.bits, self.group_size, self.v1 = vocab, dim, bits, group_size, v1
        gptq_buffers(self, dim, vocab, bits, group_size)
        self.dtype = torch.float32  # what lookups return: the runtime's dtype (set by the loader)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [...] -> [..., D]
        flat = ids.reshape(-1)  # [n]
        per = 32 // self.bits
        mask = (1 << self.bits) - 1
        codes = unpack_rows(self.qweight[:, flat], self.bits, self.embedding_dim)  # [D, n]
        shift = ((flat % per) * self.bits).to(torch.int32)  # [n]
        zeros = (self.qzeros[:, flat // per] >> shift) & mask  # [groups, n]
        if self.v1:
            zeros = (zeros + 1) & mask
        g = self.g_idx.long()  # [D]
        rows = (codes - zeros[g]).to(torch.float32) * self.scales[:, flat].to(torch.float32)[g]  # [D, n]
        return rows.t().to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def head(self) -> GPTQLinear:
        """The tied head: a GPTQLinear(D -> V) over this table's tensors (no copy)."""
        with torch.device("meta"):
            lin = GPTQLinear(self.embedding_dim, self.num_embeddings, self.bits, self.group_size, False, self.v1)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            setattr(lin, name, getattr(self, name))
        return lin

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group_size={self.group_size}"
