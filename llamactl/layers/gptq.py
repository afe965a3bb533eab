"""The GPTQ checkpoint format (transformers/optimum/GPTQModel "gptq", v1), packing and a runtime module.

Per linear layer with weight W: [out, in], b bits, group size g (ceil(in / g) groups; when g does
not divide the width the last group is shorter, as GPTQModel's loaders size it):
  qweight: int32 [ceil(in * b / 32), out]   b-bit codes packed along the input dimension
  qzeros:  int32 [groups, ceil(out * b / 32)] zero points packed along the output, stored minus 1 (v1)
  scales:  fp16  [groups, out]
  g_idx:   int32 [in]                 group of each input column (not monotone under act-order)
  W[o, i] = scales[g_idx[i], o] * (code[i, o] - zero[g_idx[i], o])
"""

from __future__ import annotations

import torch
from torch import nn


# bits -> (plane width, bit offset) low to high: GPTQModel's split-plane layout, which it uses for 5,
# 6 and 7 bits, and for 3 in its gptq_p checkpoints (utils.planar_packing, 7.6.0): per 32 codes,
# `bits` words, the low plane's first
PLANES = {3: ((2, 0), (1, 2)), 5: ((4, 0), (1, 4)), 6: ((4, 0), (2, 4)), 7: ((4, 0), (2, 4), (1, 6))}
BITS = (2, 3, 4, 5, 6, 7, 8)


def pack_rows(codes: torch.Tensor, bits: int, planar: bool = False) -> torch.Tensor:
    """codes: [R, C] ints in [0, 2^bits) -> int32 [ceil(R * bits / 32), C], packed along rows as
    GPTQModel packs them: 2, 4, 8 bits a whole number a word (low bits first; a last word that is
    not full padded with zero codes), 3 bits as one continuous bit stream (its 10-1-10-1-10
    words; `planar`: in planes, as gptq_p checkpoints store them), 5-7 bits in planes (PLANES).
    3, 5, 6, 7 bits need R to be a multiple of 32."""
    r, c = codes.shape
    codes = codes.to(torch.int64)
    ar = lambda n: torch.arange(n, dtype=torch.int64, device=codes.device)  # noqa: E731
    if 32 % bits == 0:
        per = 32 // bits
        blocks = torch.nn.functional.pad(codes, (0, 0, 0, -r % per)).view(-1, per, c)
        words = (blocks << (ar(per) * bits).view(1, per, 1)).sum(dim=1)
    elif r % 32:
        raise ValueError(f"{bits}-bit packing needs a multiple of 32 rows, not {r}")
    elif bits == 3 and not planar:  # the stream: code j of a block of 32 at bit 3j of its 3 words
        bit = (codes.view(-1, 32, 1, c) >> ar(3).view(1, 1, 3, 1)) & 1  # [blocks, 32, 3, C]
        bit = bit.reshape(-1, 3, 32, c)  # [blocks, word, bit in word, C]
        words = (bit << ar(32).view(1, 1, 32, 1)).sum(dim=2).reshape(-1, c)
    else:
        x = codes.view(-1, 32, c)
        planes = []
        for width, offset in PLANES[bits]:
            per = 32 // width
            plane = ((x >> offset) & ((1 << width) - 1)).view(-1, width, per, c)
            planes.append((plane << (ar(per) * width).view(1, 1, per, 1)).sum(dim=2))
        words = torch.cat(planes, dim=1).reshape(-1, c)  # [blocks * bits, C]
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed int32


def unpack_rows(packed: torch.Tensor, bits: int, rows: int | None = None, planar: bool = False) -> torch.Tensor:
    """int32 [ceil(R * bits / 32), C] -> int32 codes [R, C] (R = rows, or every packed row);
    planar: 3 bits in planes (gptq_p)."""
    c = packed.shape[-1]
    dev = packed.device
    if 32 % bits == 0:
        per = 32 // bits
        shifts = (torch.arange(per, dtype=torch.int32, device=dev) * bits).view(1, per, 1)
        codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)  # [R / per, per, C]
        return codes.reshape(-1, c)[:rows]
    words = packed.to(torch.int64) & 0xFFFFFFFF
    if bits == 3 and not planar:
        bit = (words.view(-1, 3, 1, c) >> torch.arange(32, device=dev).view(1, 1, 32, 1)) & 1  # [blocks, 3, 32, C]
        bit = bit.reshape(-1, 32, 3, c)  # [blocks, code, its bit, C]
        codes = (bit << torch.arange(3, device=dev).view(1, 1, 3, 1)).sum(dim=2)
    else:
        w = words.view(-1, bits, c)
        codes = torch.zeros(w.shape[0], 32, c, dtype=torch.int64, device=dev)
        row = 0
        for width, offset in PLANES[bits]:
            per = 32 // width
            shifts = (torch.arange(per, device=dev) * width).view(1, 1, per, 1)
            plane = (w[:, row : row + width].unsqueeze(2) >> shifts) & ((1 << width) - 1)  # [blocks, width, per, C]
            codes |= plane.reshape(-1, 32, c) << offset
            row += width
    return codes.reshape(-1, c)[:rows].to(torch.int32)


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
              bias: torch.Tensor | None = None, v1: bool = True, planar: bool = False) -> dict[str, torch.Tensor]:
    """codes: [out, in], zeros/scales: [groups, out], g_idx: [in] -> the checkpoint tensors: v1
    (checkpoint_format gptq) stores zero - 1, gptq_v2 and gptq_p the zero itself; planar: 3 bits
    in planes (gptq_p)."""
    stored = (zeros.to(torch.int64) - (1 if v1 else 0)) & ((1 << bits) - 1)
    t = {
        "qweight": pack_rows(codes.t().contiguous(), bits, planar),
        "qzeros": pack_rows(stored.t().contiguous(), bits, planar).t().contiguous(),
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }
    if bias is not None:
        t["bias"] = bias.to(torch.float16)
    return t


def dequantize_gptq(qweight, qzeros, scales, g_idx, bits: int, v1: bool = True, planar: bool = False) -> torch.Tensor:
    """The float weight [out, in] (in the dtype of scales) of a GPTQ-packed layer."""
    codes, zeros = layer_codes(qweight, qzeros, g_idx.numel(), scales.shape[1], bits, v1, planar)
    g = g_idx.long()
    w = (codes.t() - zeros[g]).to(scales.dtype) * scales[g]  # [in, out]
    return w.t().contiguous()


def layer_codes(qweight, qzeros, in_f: int, out_f: int, bits: int, v1: bool = True, planar: bool = False):
    """(codes [out, in], zeros [groups, out]) of a GPTQ-packed layer, the zero points as they
    are (v1's stored zero - 1 undone)."""
    codes = unpack_rows(qweight, bits, in_f, planar).t()  # [out, in]
    zeros = unpack_rows(qzeros.t().contiguous(), bits, out_f, planar).t()  # [groups, out]
    if v1:  # writers keep zero points >= 1 so that v1's "stored = zero - 1" never wraps
        zeros = (zeros + 1) & ((1 << bits) - 1)
    return codes, zeros


def gptq_buffers(module: nn.Module, in_features: int, out_features: int, bits: int, group_size: int) -> None:
    """Register a GPTQ layer's buffers on `module`: qweight, qzeros, scales, g_idx (zeros, to be assigned)."""
    groups = 1 if group_size in (-1, 0) else -(-in_features // group_size)
    words = lambda n: -(-n * bits // 32)  # noqa: E731
    module.register_buffer("qweight", torch.zeros(words(in_features), out_features, dtype=torch.int32))
    module.register_buffer("qzeros", torch.zeros(groups, words(out_features), dtype=torch.int32))
    module.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16))
    module.register_buffer("g_idx", torch.zeros(in_features, dtype=torch.int32))


class GPTQLinear(nn.Module):
    """A linear layer stored in the GPTQ format; forward dequantizes (the plain, portable path)."""

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: bool,
                 v1: bool = True, planar: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.bits, self.v1 = in_features, out_features, bits, v1
        self.planar = planar  # 3 bits in planes (gptq_p checkpoints)
        self.group_size = group_size
        gptq_buffers(self, in_features, out_features, bits, group_size)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        w = dequantize_gptq(self.qweight, self.qzeros, self.scales.to(torch.float32), self.g_idx, self.bits, self.v1,
                            self.planar)
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def swap_linears(model: nn.Module, names: list[str], make) -> None:
    """Replace the nn.Linear modules called `names` with make(linear)."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))
