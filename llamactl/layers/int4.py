"""int4 weight-only layers: llamactl's Triton kernels on CUDA, PyTorch's tinygemm elsewhere.

Where llamactl's kernels run, 4-bit layers become TritonInt4Linear (a GEMV that reads the 4-bit
codes near memory bandwidth at batch 1). Otherwise they use PyTorch's tinygemm kernels
(`_weight_int4pack_mm`), which the rest of this docstring describes.

GPTQ/RTN checkpoints are repacked at load: tinygemm computes w = (q - 8) * scale + zero per group
of consecutive input columns, so a GPTQ group with zero point z and scale s becomes
scale = s, zero = (8 - z) * s. Act-order checkpoints (g_idx not monotone) are handled by sorting
the input columns by group once, and gathering the activations in that order at run time.
CUDA takes the codes packed two per byte (even column in the high nibble, checked on an H200 with
torch 2.11); the CPU kernel takes them unpacked as int32.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llamactl.layers.fused import FusedIO
from llamactl.layers.gptq import GPTQLinear, unpack_rows
from llamactl.layers.mma import MmaCodes

INNER_K_TILES = 8


def supported(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether tinygemm takes the layer: any width (a short last group and a width that is not a
    multiple of its 128-column tiles are padded with zero columns, Int4Linear.pad)."""
    return out_features % 8 == 0 and group_size in (32, 64, 128, 256)


def padded_width(in_features: int, group_size: int) -> int:
    """in_features rounded up to whole tinygemm tiles (INNER_K_TILES x 16 columns) and groups."""
    tile = math.lcm(INNER_K_TILES * 16, group_size)
    return -(-in_features // tile) * tile


def triton_supported(in_features: int, group_size: int) -> bool:
    """Whether llamactl's int4 kernels take the layer: groups of whole 32-column words (a short
    last group is padded to a whole one, TritonInt4Linear.pad)."""
    return group_size % 32 == 0


def sort_by_group(codes: torch.Tensor, g_idx: torch.Tensor, group_size: int):
    """codes: [out, in], g_idx: [in] -> (codes with columns in group order, perm [in] or None)."""
    g = g_idx.long()
    if torch.equal(g, torch.arange(g.numel(), device=g.device) // group_size):
        return codes, None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], torch.arange(g.numel(), device=g.device) // group_size):
        raise ValueError("g_idx groups are not all of group_size columns")
    return codes[:, perm], perm


def whole_groups(codes: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """codes: [out, in] in group order, zeros: [groups, out] -> codes [out, groups * group_size]: a
    short last group filled with its zero point (weight exactly 0), so kernels see whole groups."""
    pad = zeros.shape[0] * group_size - codes.shape[1]
    if pad <= 0:
        return codes
    fill = zeros[-1].to(codes.dtype)[:, None].expand(-1, pad)  # [out, pad]
    return torch.cat([codes, fill], dim=1)


def int4_linear(codes, zeros, scales, g_idx, group_size: int, bias, device: torch.device, triton: bool) -> nn.Module:
    """The 4-bit layer for `device` from GPTQ-style codes [out, in], zeros/scales [groups, out]:
    llamactl's kernels where `triton` (layers.plan.kernels_run), else tinygemm."""
    in_features = codes.shape[1]
    if triton:
        codes, perm = sort_by_group(codes, g_idx, group_size)
        return TritonInt4Linear(whole_groups(codes, zeros, group_size), zeros, scales, perm, group_size, bias, device,
                                in_features)
    q, sz, perm = tinygemm_params(codes, zeros, scales, g_idx, group_size)
    return Int4Linear(q, sz, perm, group_size, bias, device, in_features)


def tinygemm_params(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    group_size: int):
    """codes: [out, in], zeros/scales: [groups, out], g_idx: [in] -> (q [out, groups * group_size]
    int32 in group order, scales_and_zeros [groups, out, 2] float32, perm [in] or None)."""
    codes, perm = sort_by_group(codes, g_idx, group_size)
    codes = whole_groups(codes, zeros, group_size)
    scale = scales.float()
    zero = (8 - zeros.float()) * scale
    return codes.to(torch.int32).contiguous(), torch.stack([scale, zero], dim=-1).contiguous(), perm


def dequantize_tinygemm(q: torch.Tensor, sz: torch.Tensor, perm: torch.Tensor | None, group_size: int,
                        in_features: int | None = None) -> torch.Tensor:
    """The float weight [out, in] in the checkpoint's column order (the reference for tests)."""
    n, k = q.shape
    w = (q.view(n, k // group_size, group_size).float() - 8) * sz[..., 0].t()[:, :, None] + sz[..., 1].t()[:, :, None]
    w = w.view(n, k)[:, : in_features or k]
    if perm is not None:
        out = torch.empty_like(w)
        out[:, perm] = w
        w = out
    return w


def pack(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """q: [out, in] int32 codes -> the tinygemm weight for `device`."""
    if device.type == "cuda":
        u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # even column in the high nibble
        return torch.ops.aten._convert_weight_to_int4pack(u8.to(device), INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device), INNER_K_TILES)


@torch.library.custom_op("llamactl::int4pack_mm_cpu", mutates_args=())
def int4pack_mm_cpu(x: torch.Tensor, packed: torch.Tensor, group_size: int, sz: torch.Tensor) -> torch.Tensor:
    """PyTorch's CPU tinygemm as an opaque op: Inductor's own lowering of it fails on the CPU
    ("group size must be a scalar", torch 2.13), so a compiled CPU step calls it as it is."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)


@int4pack_mm_cpu.register_fake
def _(x, packed, group_size, sz):
    return x.new_empty(x.shape[0], sz.shape[1])


class Int4Linear(nn.Module):
    """y = x W^T with W in 4 bits, groups along the input dimension, bf16 activations."""

    def __init__(self, q, sz, perm, group_size: int, bias: torch.Tensor | None, device: torch.device,
                 in_features: int | None = None):
        """q: [out, groups * group_size] (tinygemm_params), in_features: the layer's real width
        (less than q's when the last group is short)."""
        super().__init__()
        self.out_features, width = q.shape
        self.in_features = in_features or width
        self.group_size = group_size
        # tinygemm multiplies whole 128-column tiles: a narrower last tile gets zero columns (codes
        # 8, scale 0, zero 0: weight 0) and x zeros there and in a short last group's columns
        extra = padded_width(width, group_size) - width
        self.pad = extra + width - self.in_features
        if extra:
            q = torch.cat([q, torch.full((q.shape[0], extra), 8, dtype=q.dtype, device=q.device)], dim=1)
            sz = torch.cat([sz, sz.new_zeros(extra // group_size, *sz.shape[1:])])
        self.register_buffer("weight_packed", pack(q, device))
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=torch.bfloat16))
        self.register_buffer("perm", None if perm is None else perm.to(device))
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=torch.bfloat16), requires_grad=False)
        self._mm = torch.ops.aten._weight_int4pack_mm if device.type == "cuda" else int4pack_mm_cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.perm is not None:
            x2 = x2[:, self.perm]
        if self.pad:
            x2 = F.pad(x2, (0, self.pad))  # [M, in + pad]
        x2 = x2.contiguous()  # the head's input (the last position of a prefill) is a strided view
        y = self._mm(x2, self.weight_packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(dtype)

    @classmethod
    def from_gptq(cls, lin, group_size: int) -> "Int4Linear":
        q, sz, perm = tinygemm_params(*_gptq_codes(lin), lin.g_idx, _group(lin, group_size))
        return cls(q, sz, perm, _group(lin, group_size), lin.bias, lin.qweight.device, lin.in_features)


def _group(lin, group_size: int) -> int:
    group_size = getattr(lin, "group_size", group_size)  # a layer's own (a low-bit head's may differ)
    return group_size if group_size > 0 else lin.in_features


def _gptq_codes(lin):
    """A 4-bit GPTQLinear -> (codes [out, in], zeros [groups, out], scales [groups, out])."""
    codes = unpack_rows(lin.qweight, 4, lin.in_features).t()  # [out, in]
    zeros = unpack_rows(lin.qzeros.t().contiguous(), 4, lin.out_features).t()  # [groups, out]
    if lin.v1:
        zeros = (zeros + 1) & 0xF
    return codes, zeros, lin.scales


@torch.no_grad()
def use_int4_kernels(model, group_size: int, triton: bool) -> int:
    """Swap every 4-bit GPTQLinear a kernel supports for a fast int4 layer (llamactl's kernels
    where `triton`, else tinygemm); returns how many."""
    swapped = 0
    for name, mod in list(model.named_modules()):
        if not (isinstance(mod, GPTQLinear) and mod.bits == 4):
            continue
        g, device = _group(mod, group_size), mod.qweight.device
        ok = triton_supported(mod.in_features, g) if triton else supported(mod.in_features, mod.out_features, g)
        if ok:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child,
                    int4_linear(*_gptq_codes(mod), mod.g_idx, g, mod.bias, device, triton))
            swapped += 1
    return swapped


class TritonInt4Linear(nn.Module, FusedIO, MmaCodes):
    """y = x W^T with W in 4 bits (groups along the input), in the layout of kernels.gemv.

    Single rows run the int4 GEMV (reads 4 bits a weight); a decode batch reads the weights once
    for all rows: 2 to skinny.LAYER_ROWS rows of a fusable layer with groups of a multiple of 128
    on kernels.skinny (the norm before, SwiGLU and the residual folded in; with int16 inputs, the
    GEMV's default, the codes on the int8 MMA with x in 16-bit fixed point), else up to
    multirow.int4_rows rows (64 with groups of 128, else 16) on kernels.multirow; more rows (larger
    batches, prefill) dequantize the layer to 16 bits with a Triton kernel and use cuBLAS. With
    use_mma (RuntimeOptions.mma), 2 to 64 rows of bf16 or fp16 run the tensor-core kernel
    (kernels.mma) on a second copy of the codes in its layout, the norm and SwiGLU unfused.
    """

    mma_kind = "int4"

    def __init__(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, perm: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None, device: torch.device, in_features: int | None = None):
        """codes: [out, groups * group_size] in group order (whole_groups), zeros/scales: [groups, out],
        perm: [in] or None, in_features: the real width (less than codes' when the last group is short)."""
        super().__init__()
        from llamactl.kernels.int4_layout import pack_int4

        self._set(pack_int4(codes.to(device)), scales.t().to(device=device, dtype=torch.float16),
                  zeros.t().to(device=device, dtype=torch.uint8), None if perm is None else perm.to(device), group_size,
                  None if bias is None else bias.to(device=device, dtype=torch.bfloat16), in_features)

    def _set(self, qweight, scales, zeros, perm, group_size: int, bias, in_features: int | None = None) -> None:
        self.out_features, width = qweight.shape[0], qweight.shape[1] * 8
        self.in_features = in_features or width
        self.pad = width - self.in_features  # a short last group's columns: x is zero there
        self.group_size = group_size
        self.register_buffer("qweight", qweight.contiguous())  # [out, in // 8] int32
        self.register_buffer("scales", scales.contiguous())  # [out, groups] fp16
        self.register_buffer("zeros", zeros.contiguous())  # [out, groups] uint8
        self.register_buffer("perm", perm)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.inputs = "float"  # what the batch-1 GEMV multiplies the weights with (RuntimeOptions.quant_inputs)
        self._init_fused_io()

    def _mma_shape(self) -> tuple[int, int, int]:
        return self.out_features, self.qweight.shape[1] * 8, self.group_size

    def _mma_codes(self):
        codes = unpack_rows(self.qweight.t(), 4).t()  # [N, K]: nibble j of word i is column 8 i + j
        return codes, self.zeros.t().float(), self.scales.t().float()

    def can_fuse(self) -> bool:
        # act-order layers gather x first, a short last group pads it: not fused
        return self.bias is None and self.perm is None and self.pad == 0

    def _skinny_takes(self, rows: int) -> bool:
        return self.group_size % 128 == 0 and super()._skinny_takes(rows)  # the kernel's blocks lie in one group

    @classmethod
    def concat(cls, mods: list["TritonInt4Linear"]) -> "TritonInt4Linear | None":
        """One layer computing the outputs of `mods` (same input) side by side, or None when their
        input orders (act-order permutations) or group sizes differ."""
        first = mods[0]
        if any(m.group_size != first.group_size or m.perm is not None or (m.bias is None) != (first.bias is None)
               or m.pad for m in mods):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        bias = None if first.bias is None else torch.cat([m.bias for m in mods])
        fused._set(torch.cat([m.qweight for m in mods]), torch.cat([m.scales for m in mods]),
                   torch.cat([m.zeros for m in mods]), None, first.group_size, bias)
        return fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] ([..., 2 in] with glu), residual: [..., out] or None -> [..., out]
        from llamactl.kernels.gemv_int4 import dequantize_int4, gemv_int4
        from llamactl.kernels.multirow import int4_rows, multirow_int4

        if x.numel() == self._input_width() and self.can_fuse():
            y = gemv_int4(x.reshape(-1), self.qweight, self.scales, self.zeros, self.group_size, *self._norm_args(),
                          None if residual is None else residual.reshape(-1), self.glu, self.glu_out, self.inputs,
                          self.pdl, self.pins)
            return y.view(*x.shape[:-1], self._output_width())
        rows = self._skinny_rows(x) if self.mma is None else 0
        if rows:  # a decode batch: the weights read once for all rows, SwiGLU and the residual folded in
            from llamactl.kernels.skinny import skinny_int4, skinny_int4_i8

            x2, r2 = self._skinny_io(x, rows, residual)
            product = skinny_int4_i8 if self.inputs == "int16" else skinny_int4
            # not a dependent launch: the int4 decode batches ran slower as one on the H200, where
            # the 16-bit ones gained (docs/bench/README.md, 2026-12-04)
            y = product(x2, self.qweight, self.scales, self.zeros, self.group_size, r2, self.glu)
            return self._skinny_out(y, x.shape, residual)
        x2 = self._unfused_input(x).reshape(-1, self.in_features)  # [M, in]
        if self.perm is not None:
            x2 = x2[:, self.perm]
        if self.pad:
            x2 = F.pad(x2, (0, self.pad))  # [M, groups * group_size]
        if x2.shape[0] == 1:  # an act-order row or a short last group
            y = gemv_int4(x2[0].contiguous(), self.qweight, self.scales, self.zeros, self.group_size,
                          inputs=self.inputs, pdl=self.pdl, pins=self.pins)[None]
        elif self._mma_takes(x2.shape[0], x2.dtype):
            y = self._mma(x2)  # a decode batch on the tensor cores
        elif x2.shape[0] <= int4_rows(self.group_size):  # a small decode batch: every weight read once for all rows
            y = multirow_int4(x2, self.qweight, self.scales, self.zeros, self.group_size)
        else:
            y = F.linear(x2, dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        y = self._unfused_output(y.view(*x.shape[:-1], self.out_features))
        return y if residual is None else residual + y

    def product(self, rows: int) -> str:
        """What multiplies `rows` rows (bench rows name it)."""
        from llamactl.kernels.multirow import int4_rows, splitk_takes

        if rows == 1:
            return "int4 GEMV"
        if self._mma_takes(rows):
            return "int4 tensor-core MMA"
        if self._skinny_takes(rows):
            return "int4 skinny int8 MMA" if self.inputs == "int16" else "int4 skinny"
        if rows <= int4_rows(self.group_size):
            return "int4 split-K" if splitk_takes(self.group_size) else "int4 multirow"
        return "int4 dequantize + cuBLAS"
