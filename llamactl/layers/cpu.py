"""CPU layers on llamactl's own kernels (kernels.cpu): low-bit weights read once per step, and a
16-bit product for bf16 weights.

CpuQuantLinear takes any GPTQ-format layer of 2 to 8 bits (any group size whose groups hold whole
blocks of 32 inputs, a short last group too; act-order through a permutation of x): codes of up to
4 bits are stored as nibbles, 5 and 6 bits as nibbles and one or two high bit planes, 7 and 8 bits
as bytes, in tiles of 16 output rows interleaved by 4 inputs, and multiplied as they are with x rounded to int8 per block of 32 (the kernel's comment
says how). Decode rows (up to kernels.cpu.MAX_ROWS) run the kernel; a bf16 prefill's rows run it
too (4 rows a weight load at 4 and 8 bits) where prefill_product chooses it, else dequantize the
layer for torch's matmul (oneDNN; in bf16, or exactly in float32 for float32 activations).

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
TILE = 16  # output rows a tile of the kernel's layout interleaves


def _qgemv_fake(x, w, scales, zeros, blk2grp, perm, bits, n):
    return x.new_empty(x.shape[0], n)


def _bgemv_fake(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _dequant_fake(w, scales, zeros, blk2grp, bits, n, k):
    return w.new_empty(n, k, dtype=torch.bfloat16)


def _attention_fake(q, k, v, pos, scale):
    return torch.empty_like(q)


@functools.lru_cache(maxsize=None)
def kernels_load() -> str | None:
    """None when the CPU kernels are built and loaded (with their shapes for torch.compile), else
    why not (kernels.cpu.load)."""
    problem = kcpu.load()
    if problem is None:
        torch.library.register_fake("llamactl_cpu::qgemv", _qgemv_fake)
        torch.library.register_fake("llamactl_cpu::bgemv", _bgemv_fake)
        torch.library.register_fake("llamactl_cpu::dequant", _dequant_fake)
        torch.library.register_fake("llamactl_cpu::decode_attention", _attention_fake)
    return problem


def quant_fast() -> bool:
    """Whether the low-bit kernel has its vector path here (AVX-512 VNNI); without it the layers
    keep torch's kernels (tinygemm, int8pack), which have AVX2 code."""
    return kernels_load() is None and bool(kcpu.features() & kcpu.VNNI)


def bf16_fast() -> bool:
    """Whether the bf16 product has its vector path here (AVX-512 BF16)."""
    return kernels_load() is None and bool(kcpu.features() & kcpu.BF16)


def pack_tiles(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [N, K] (below 2^bits; bits 4, 5, 6 or 8), K a multiple of 32 -> uint8 [ceil(N / 16),
    K * bits / 8 * 16]: tiles of 16 rows (the last padded with zero rows), interleaved by 4 inputs
    (the kernel's layout, cpu_gemv.cpp); 5 and 6 bits: the low 4 bits as for 4, then the high bit
    planes (_high_planes)."""
    n, k = codes.shape
    c = F.pad(codes.to(torch.uint8), (0, 0, 0, -n % TILE)).view(-1, TILE, k)  # [T, 16, K]
    t = c.shape[0]
    if bits == 8:  # unit u: [16 rows, inputs 4u .. 4u + 3]
        return c.view(t, TILE, k // 4, 4).permute(0, 2, 1, 3).reshape(t, -1).contiguous()
    packed = torch.cat([(v[..., 0] | (v[..., 1] << 4)).reshape(t, -1) for v in _nibble_units(c & 0x0F)], dim=1)
    if bits > 4:
        packed = torch.cat([packed, _high_planes(c, bits)], dim=1)
    return packed.contiguous()


def _nibble_units(c: torch.Tensor) -> list[torch.Tensor]:
    """c: [T, 16, K] codes -> per chunk of 64 inputs (a last one of 32) [T, units, 16, 4, 2]: each
    unit's 64 bytes (row r, input j at byte 4 r + j), the code of its low nibble and its high one
    (a full chunk: unit u holds inputs 4u + j and 32 + 4u + j; the last of 32: 4u + j, 16 + 4u + j)."""
    t, _, k = c.shape
    full = k // 64 * 64
    out = []
    if full:
        v = c[:, :, :full].reshape(t, TILE, -1, 2, 8, 4)  # [T, 16, chunks, half, unit, j]
        out.append(v.permute(0, 2, 4, 1, 5, 3).reshape(t, -1, TILE, 4, 2))
    if k - full:
        v = c[:, :, full:].reshape(t, TILE, 2, 4, 4)  # [T, 16, half, unit, j]
        out.append(v.permute(0, 3, 1, 4, 2).reshape(t, -1, TILE, 4, 2))
    return out


def _high_planes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """c: [T, 16, K] 5- or 6-bit codes -> uint8 [T, K * (bits - 4) * 2]: per unit of the nibble
    layout, per nibble (low, high) and per extra bit e, 64 bits (8 bytes, little-endian) whose bit
    4 r + j is bit 4 + e of that nibble's code at byte 4 r + j; the kernel adds them as byte masks."""
    t = c.shape[0]
    units = torch.cat(_nibble_units(c), dim=1)  # [T, U, 16, 4, 2]
    planes = torch.stack([(units >> (4 + e)) & 1 for e in range(bits - 4)], dim=-1)  # [T, U, 16, 4, 2, E]
    planes = planes.permute(0, 1, 4, 5, 2, 3).reshape(t, -1, 8, 8)  # [T, U * 2 * E * 8 bytes, 8 bits]
    weights = (1 << torch.arange(8, dtype=torch.int32))
    return (planes.to(torch.int32) * weights).sum(-1).to(torch.uint8).reshape(t, -1)


def unpack_tiles(packed: torch.Tensor, n: int, k: int, bits: int) -> torch.Tensor:
    """pack_tiles' inverse: -> codes [N, K] (uint8)."""
    t = packed.shape[0]
    if bits == 8:
        c = packed.view(t, k // 4, TILE, 4).permute(0, 2, 1, 3).reshape(t * TILE, k)
        return c[:n]
    nib = packed[:, : k * 8]
    full = k // 64 * 64
    units = []
    if full:
        v = nib[:, : full * 8].reshape(t, -1, TILE, 4)  # [T, U, 16, 4]
        units.append(v)
    if k - full:
        units.append(nib[:, full * 8 :].reshape(t, 4, TILE, 4))
    u = torch.cat(units, dim=1)  # [T, U, 16, 4] bytes
    codes = torch.stack([u & 0x0F, u >> 4], dim=-1)  # [T, U, 16, 4, 2]
    if bits > 4:
        e_n = bits - 4
        raw = packed[:, k * 8 :].reshape(t, u.shape[1], 2, e_n, 8)  # [T, U, nibble, e, 8 bytes]
        bitv = (raw.to(torch.int32)[..., None] >> torch.arange(8, dtype=torch.int32)) & 1  # [T, U, 2, E, 8, 8]
        bitv = bitv.reshape(t, u.shape[1], 2, e_n, TILE, 4).permute(0, 1, 4, 5, 2, 3)  # [T, U, 16, 4, 2, E]
        codes = codes | sum(bitv[..., e].to(torch.uint8) << (4 + e) for e in range(e_n))
    # back to [T, 16, K]: undo _nibble_units
    out = torch.empty(t, TILE, k, dtype=torch.uint8)
    done = 0
    if full:
        chunks = full // 64
        v = codes[:, : chunks * 8].reshape(t, chunks, 8, TILE, 4, 2).permute(0, 3, 1, 5, 2, 4)  # [T,16,ch,half,unit,j]
        out[:, :, :full] = v.reshape(t, TILE, full)
        done = chunks * 8
    if k - full:
        v = codes[:, done:].reshape(t, 4, TILE, 4, 2).permute(0, 2, 4, 1, 3)  # [T, 16, half, unit, j]
        out[:, :, full:] = v.reshape(t, TILE, 32)
    return out.reshape(t * TILE, k)[:n]


def tile_rows(v: torch.Tensor) -> torch.Tensor:
    """[N, G] -> [ceil(N / 16), G, 16] (the last tile padded with zeros): per tile and group the 16
    rows side by side, as the kernel loads them."""
    n, g = v.shape
    return F.pad(v, (0, 0, 0, -n % TILE)).view(-1, TILE, g).transpose(1, 2).contiguous()


def untile_rows(v: torch.Tensor, n: int) -> torch.Tensor:
    """tile_rows' inverse: -> [N, G]."""
    return v.transpose(1, 2).reshape(-1, v.shape[1])[:n]


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
        """codes: [out, in] in the order x is read (perm applied), zeros (integers 0..255) and
        scales: [groups, out]. Scales stay fp16 where they are fp16 exactly (GPTQ checkpoints),
        else float32."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.bits = bits
        self.store_bits = 4 if bits <= 4 else bits if bits <= 6 else 8  # 5, 6: nibbles and high bit planes
        s = scales.t().float()  # [out, groups]
        if torch.equal(s.half().float(), s):
            s = s.half()
        # frozen parameters rather than buffers: Dynamo checks buffers against each other for
        # aliasing on every call of a compiled step, parameters not (about 1.4 ms of a 30-layer
        # CPU step)
        frozen = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
        self.weight_packed = frozen(pack_tiles(codes, self.store_bits))
        self.scales = frozen(tile_rows(s))
        self.zeros = frozen(tile_rows(zeros.t().to(torch.uint8)))
        self.blk2grp = frozen(blk2grp)
        self.perm = frozen(torch.empty(0, dtype=torch.long) if perm is None else perm.long().contiguous())
        self.bias = None if bias is None else frozen(bias.float())

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

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [out, in] in x's column order, zeros [groups, out], scales [groups, out])."""
        n = self.out_features
        codes = unpack_tiles(self.weight_packed, n, self.in_features, self.store_bits)
        return codes, untile_rows(self.zeros, n).t(), untile_rows(self.scales, n).t()

    @classmethod
    def concat(cls, mods: list["CpuQuantLinear"]) -> "CpuQuantLinear | None":
        """One layer computing the outputs of `mods` (same input, same layout) side by side."""
        first = mods[0]
        same = all(m.store_bits == first.store_bits and torch.equal(m.blk2grp, first.blk2grp)
                   and torch.equal(m.perm, first.perm) and (m.bias is None) == (first.bias is None)
                   and m.scales.shape[1] == first.scales.shape[1] for m in mods)
        if not same:
            return None
        codes, zeros, scales = zip(*(m.parts() for m in mods))
        bias = None if first.bias is None else torch.cat([m.bias for m in mods])
        new = cls(torch.cat(codes), torch.cat(zeros, 1), torch.cat([s.float() for s in scales], 1),
                  first.perm if first.perm.numel() else None, first.blk2grp, max(m.bits for m in mods), bias)
        return new

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in x's column order (perm applied), for prefill."""
        codes, zeros, scales = self.parts()
        g = self.blk2grp.long().repeat_interleave(BLOCK)  # [in]
        s = scales.t()[:, g].to(dtype)  # [out, in]
        return codes.to(dtype) * s - s * zeros.t()[:, g].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        if self._own_product(x2):
            y = torch.ops.llamactl_cpu.qgemv.default(x2.contiguous(), self.weight_packed, self.scales, self.zeros,
                                             self.blk2grp, self.perm, self.store_bits, self.out_features)
        else:
            xp = x2[:, self.perm] if self.perm.numel() else x2
            if xp.dtype == torch.float32:  # float32 stays exact (a quality measurement's prefill)
                y = F.linear(xp, self.dequantized(torch.float32))
            else:
                w = torch.ops.llamactl_cpu.dequant.default(self.weight_packed, self.scales, self.zeros, self.blk2grp,
                                                   self.store_bits, self.out_features, self.in_features)  # [out, in] bf16
                y = F.linear(xp, w)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def _own_product(self, x2: torch.Tensor) -> bool:
        """Whether llamactl's kernel multiplies these rows: a decode step's (up to kcpu.MAX_ROWS), and
        a bf16 prefill's where prefill_product says so; a float32 prefill stays exact (dequantized)."""
        rows = x2.shape[0]
        return rows <= kcpu.MAX_ROWS or (x2.dtype == torch.bfloat16 and prefill_product() == "llamactl")

    def product(self, rows: int) -> str:
        """What multiplies `rows` rows of bf16 (bench rows name it)."""
        if rows <= kcpu.MAX_ROWS:
            return "low-bit llamactl cpu"
        if prefill_product() == "onednn":
            return "low-bit dequantize + oneDNN"
        return "low-bit llamactl cpu" + (" (4 rows a load)" if self.store_bits in (4, 8) else "")


class CpuLinear(nn.Linear):
    """A bf16 nn.Linear whose decode rows run llamactl's AVX-512 BF16 product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > kcpu.MAX_ROWS or self.weight.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.llamactl_cpu.bgemv.default(x2.contiguous(), self.weight)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, rows: int) -> str:
        """What multiplies `rows` rows (bench rows name it)."""
        return "bf16 llamactl cpu" if rows <= kcpu.MAX_ROWS else "bf16 oneDNN"


@functools.lru_cache(maxsize=None)
def prefill_product() -> str:
    """What multiplies a bf16 prefill's rows with low-bit weights: "llamactl" (the kernel with
    AVX-512 VNNI, x rounded to int8 as in decode; 4 rows a weight load at 4 and 8 bits, a row at a
    time at 5 and 6), or "onednn" (dequantize, then torch's bf16 matmul). On a 2-core Sapphire
    Rapids without AMX, at 128 rows of the 17M and 135M models' layers, the kernel took 0.30-0.50x
    the time of dequantize + oneDNN at 4 and 8 bits and 0.55-0.75x at 5 and 6 (docs/bench/cpu.md);
    with AMX oneDNN's tiles are left the work (not measured here)."""
    return "llamactl" if quant_fast() and not kcpu.has_amx() else "onednn"


@torch.no_grad()
def use_cpu_kernels(model) -> int:
    """Swap every GPTQ-format layer of 2 to 8 bits the CPU kernel takes for CpuQuantLinear;
    returns how many (0 when the kernels did not load or have no vector path here)."""
    if not quant_fast():
        return 0
    swapped = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, GPTQLinear) and mod.qweight.device.type == "cpu":
            fast = CpuQuantLinear.from_gptq(mod)
            if fast is not None:
                swap_linears(model, [name], lambda _: fast)  # noqa: B023 (called at once)
                swapped += 1
    return swapped
