"""CPU layers on llamactl's own kernels (kernels.cpu): low-bit weights read once per step, and a
16-bit product for bf16 weights.

CpuQuantLinear takes any GPTQ-format layer of 2 to 8 bits (any group size whose groups hold whole
blocks of 32 inputs, a short last group too; act-order through a permutation of x): codes of up to
4 bits are stored as nibbles, 5 to 8 bits as bytes, and multiplied as they are with x rounded to
int8 per block of 32 (the kernel's docstring says how). Decode rows (up to kernels.cpu.MAX_ROWS)
run the kernel; more rows (prefill) dequantize the layer for torch's matmul (oneDNN; in bf16, or
exactly in float32 for float32 activations).

CpuLinear: a bf16 nn.Linear whose decode rows run the AVX-512 BF16 product (x rounded to bf16, as
bf16 activations are anyway); more rows torch's matmul.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from llamactl.kernels import cpu as kcpu
from llamactl.layers.gptq import GPTQLinear, layer_codes, swap_linears

BLOCK = 32


def _qgemv_fake(x, w, scales, szeros, blk2grp, perm, bits):
    return x.new_empty(x.shape[0], w.shape[0])


def _bgemv_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _dequant_fake(w, scales, szeros, blk2grp, bits, k):
    return w.new_empty(w.shape[0], k, dtype=torch.bfloat16)


@functools.lru_cache(maxsize=None)
def kernels_load() -> str | None:
    """None when the CPU kernels are built and loaded (with their shapes for torch.compile), else
    why not (kernels.cpu.load)."""
    problem = kcpu.load()
    if problem is None:
        torch.library.register_fake("llamactl_cpu::qgemv", _qgemv_fake)
        torch.library.register_fake("llamactl_cpu::bgemv", _bgemv_fake)
        torch.library.register_fake("llamactl_cpu::dequant", _dequant_fake)
    return problem


def quant_fast() -> bool:
    """Whether the low-bit kernel has its vector path here (AVX-512 VNNI); without it the layers
    keep torch's kernels (tinygemm, int8pack), which have AVX2 code."""
    return kernels_load() is None and bool(kcpu.features() & kcpu.VNNI)


def bf16_fast() -> bool:
    """Whether the bf16 product has its vector path here (AVX-512 BF16)."""
    return kernels_load() is None and bool(kcpu.features() & kcpu.BF16)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes: [N, K] in 0..15, K a multiple of 32 -> uint8 [N, K / 2] in the kernel's layout: per
    chunk of 64 inputs 32 bytes, byte j = input j | input 32 + j << 4 (a last chunk of 32: 16 bytes)."""
    n, k = codes.shape
    c = codes.to(torch.uint8)
    full = k // 64 * 64
    parts = []
    if full:
        v = c[:, :full].reshape(n, -1, 2, 32)
        parts.append((v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, -1))
    if k - full:
        v = c[:, full:].reshape(n, 1, 2, 16)
        parts.append((v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, -1))
    return torch.cat(parts, dim=1).contiguous()


def unpack_nibbles(packed: torch.Tensor, k: int) -> torch.Tensor:
    """pack_nibbles' inverse: uint8 [N, K / 2] -> codes [N, K] (uint8)."""
    n = packed.shape[0]
    full = k // 64 * 64
    lo, hi = packed & 0x0F, packed >> 4
    parts = []
    if full:
        parts.append(torch.stack([lo[:, : full // 2].reshape(n, -1, 32), hi[:, : full // 2].reshape(n, -1, 32)], 2).reshape(n, -1))
    if k - full:
        parts.append(torch.cat([lo[:, full // 2 :], hi[:, full // 2 :]], dim=1))
    return torch.cat(parts, dim=1)


def block_groups(g_idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """g_idx: [K] -> (perm [K] or None: x's columns in group order (act-order), blk2grp [K / 32]
    int32), or (None, None) when a block of 32 inputs would span two groups."""
    k = g_idx.numel()
    if k % BLOCK:
        return None, None
    g = g_idx.long()
    perm = None
    if bool((g[1:] < g[:-1]).any()):
        perm = torch.argsort(g, stable=True)
        g = g[perm]
    blocks = g.view(-1, BLOCK)
    if not bool((blocks == blocks[:, :1]).all()):
        return None, None
    return perm, blocks[:, 0].to(torch.int32).contiguous()


class CpuQuantLinear(nn.Module):
    """y = x W^T, W = s * (code - zero) per group along the input, 2 to 8 bits."""

    def __init__(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, perm: torch.Tensor | None,
                 blk2grp: torch.Tensor, bits: int, bias: torch.Tensor | None):
        """codes: [out, in] in the order x is read (perm applied), zeros/scales: [groups, out]."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.bits = bits
        self.store_bits = 4 if bits <= 4 else 8
        w = pack_nibbles(codes) if self.store_bits == 4 else codes.to(torch.uint8).contiguous()
        s = scales.float().t().contiguous()  # [out, groups]
        self.register_buffer("weight_packed", w)
        self.register_buffer("scales", s)
        self.register_buffer("szeros", (s * zeros.float().t()).contiguous())
        self.register_buffer("blk2grp", blk2grp)
        self.register_buffer("perm", torch.empty(0, dtype=torch.long) if perm is None else perm.long().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @classmethod
    def from_gptq(cls, lin: GPTQLinear) -> "CpuQuantLinear | None":
        """The CPU layer of a GPTQLinear, or None where its groups do not hold whole blocks of 32."""
        perm, blk2grp = block_groups(lin.g_idx)
        if blk2grp is None:
            return None
        codes, zeros = layer_codes(lin.qweight, lin.qzeros, lin.in_features, lin.out_features, lin.bits, lin.v1,
                                   lin.planar)
        if perm is not None:
            codes = codes[:, perm]
        return cls(codes, zeros, lin.scales, perm, blk2grp, lin.bits, lin.bias)

    @classmethod
    def concat(cls, mods: list["CpuQuantLinear"]) -> "CpuQuantLinear | None":
        """One layer computing the outputs of `mods` (same input, same layout) side by side."""
        first = mods[0]
        same = all(m.store_bits == first.store_bits and torch.equal(m.blk2grp, first.blk2grp)
                   and torch.equal(m.perm, first.perm) and (m.bias is None) == (first.bias is None)
                   and m.scales.shape[1] == first.scales.shape[1] for m in mods)
        if not same:
            return None
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = first.in_features, sum(m.out_features for m in mods)
        new.bits, new.store_bits = max(m.bits for m in mods), first.store_bits
        for name in ("weight_packed", "scales", "szeros"):
            new.register_buffer(name, torch.cat([getattr(m, name) for m in mods]))
        new.register_buffer("blk2grp", first.blk2grp)
        new.register_buffer("perm", first.perm)
        new.bias = None if first.bias is None else nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=False)
        return new

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in x's column order (perm applied), for prefill."""
        k = self.in_features
        codes = unpack_nibbles(self.weight_packed, k) if self.store_bits == 4 else self.weight_packed
        g = self.blk2grp.long().repeat_interleave(BLOCK)  # [in]
        return (codes.to(dtype) * self.scales[:, g].to(dtype) - self.szeros[:, g].to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        if x2.shape[0] <= kcpu.MAX_ROWS:
            y = torch.ops.llamactl_cpu.qgemv(x2.contiguous(), self.weight_packed, self.scales, self.szeros,
                                             self.blk2grp, self.perm, self.store_bits)
        else:
            xp = x2[:, self.perm] if self.perm.numel() else x2
            if xp.dtype == torch.float32:  # float32 stays exact (a quality measurement's prefill)
                y = F.linear(xp, self.dequantized(torch.float32))
            else:
                w = torch.ops.llamactl_cpu.dequant(self.weight_packed, self.scales, self.szeros, self.blk2grp,
                                                   self.store_bits, self.in_features)  # [out, in] bf16
                y = F.linear(xp, w)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


class CpuLinear(nn.Linear):
    """A bf16 nn.Linear whose decode rows run llamactl's AVX-512 BF16 product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > kcpu.MAX_ROWS or self.weight.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.llamactl_cpu.bgemv(x2.contiguous(), self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)


@torch.no_grad()
def use_cpu_kernels(model) -> int:
    """Swap every GPTQ-format layer of 2 to 8 bits the CPU kernel takes for CpuQuantLinear;
    returns how many (0 when the kernels did not load or have no vector path here)."""
    if not quant_fast():
        return 0
    names = [name for name, mod in model.named_modules()
             if isinstance(mod, GPTQLinear) and mod.qweight.device.type == "cpu" and block_groups(mod.g_idx)[1] is not None]
    swap_linears(model, names, CpuQuantLinear.from_gptq)
    return len(names)
