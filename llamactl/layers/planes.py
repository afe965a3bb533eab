"""3-, 5- and 6-bit linear layers on packed kernels.

A GPTQ-format layer of these widths (quantize --target-bpw writes them; GPTQModel's planar format
for 5 and 6 bits, its continuous one for 3) is re-laid out at load into two bit planes per output
row. For 5 and 6 bits the low plane is 4 bits, in the int4 kernels' layout, so these layers are
int4 layers with a high plane beside (Int4PlanesLinear): one row runs the int4 GEMV, which adds
the high bits (kernels.high_bits) and folds the norm, SwiGLU and residual as for 4 bits. 3-bit
layers (PlanesLinear), and 2 to kernels.planes.MAX_ROWS rows of any of them, run the plane kernel,
which reads the packed weight once for all rows; more rows (a prefill) dequantize for cuBLAS.
Where Triton cannot run (the CPU without its interpreter), the layer stays a GPTQLinear, which
dequantizes on every call (llamactl's CPU kernels take these widths: layers.cpu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llamactl.layers.gptq import GPTQLinear, layer_codes, pack_rows, swap_linears, unpack_rows
from llamactl.layers.int4 import TritonInt4Linear, whole_groups

SPLITS = {3: (2, 1), 5: (4, 1), 6: (4, 2)}  # bits -> (low plane, high plane) widths
PLANE_BITS = tuple(SPLITS)


def split_planes(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """codes: [N, K] (K a multiple of 32) -> (low, high) planes, int32 [N, K * width / 32] each:
    each output row's codes packed along the input, low bits first."""
    lo_w, hi_w = SPLITS[bits]
    planes = (codes & ((1 << lo_w) - 1), codes >> lo_w)
    return tuple(pack_rows(p.t(), w).t().contiguous() for p, w in zip(planes, (lo_w, hi_w)))


def dequantize_planes(lo: torch.Tensor, hi: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                      group: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in dtype (torch ops: prefill, and the CPU)."""
    lo_w, hi_w = SPLITS[bits]
    codes = unpack_rows(lo.t(), lo_w).t() | (unpack_rows(hi.t(), hi_w).t() << lo_w)  # [N, K]
    g = torch.arange(codes.shape[1], device=codes.device) // group
    return ((codes - zeros[:, g].to(torch.int32)).to(torch.float32) * scales[:, g].float()).to(dtype)


class PlanesLinear(nn.Module):
    """y = x W^T with W in 3, 5 or 6 bits, groups along the input (kernels.planes' layout)."""

    def __init__(self, lin: GPTQLinear):
        super().__init__()
        self.in_features, self.out_features, self.bits = lin.in_features, lin.out_features, lin.bits
        self.group_size = lin.in_features if lin.group_size in (-1, 0) else lin.group_size
        codes, zeros = layer_codes(lin.qweight, lin.qzeros, lin.in_features, lin.out_features, lin.bits, lin.v1,
                                   lin.planar)  # [out, in], [groups, out]
        codes, zeros = codes.contiguous(), zeros.t()
        lo, hi = split_planes(codes, lin.bits)
        self.register_buffer("lo", lo)  # [out, in * low width / 32]
        self.register_buffer("hi", hi)  # [out, in * high width / 32]
        self.register_buffer("scales", lin.scales.t().contiguous())  # [out, groups] fp16
        self.register_buffer("zeros", zeros.to(torch.uint8).contiguous())  # [out, groups]
        self.bias = lin.bias

    @staticmethod
    def fits(lin: nn.Module) -> bool:
        """A GPTQ layer of a plane width, in group order (no act-order) and of whole 32-column blocks."""
        if not (isinstance(lin, GPTQLinear) and lin.bits in PLANE_BITS and lin.in_features % 32 == 0):
            return False
        g = lin.in_features if lin.group_size in (-1, 0) else lin.group_size
        order = torch.arange(lin.in_features, device=lin.g_idx.device) // g
        return bool(torch.equal(lin.g_idx.long(), order))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from llamactl.kernels.planes import MAX_ROWS, gemv_planes

        x2 = x.reshape(-1, self.in_features)  # [R, in]
        if x2.shape[0] <= MAX_ROWS:
            y = gemv_planes(x2, self.lo, self.hi, self.scales, self.zeros, *SPLITS[self.bits], self.group_size)
        else:
            y = F.linear(x2, dequantize_planes(self.lo, self.hi, self.scales, self.zeros, self.bits, self.group_size,
                                               x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, rows: int) -> str:
        """What multiplies `rows` rows (bench rows name it)."""
        from llamactl.kernels.planes import MAX_ROWS

        return f"int{self.bits} " + ("planes" if rows <= MAX_ROWS else "dequantize + cuBLAS")


class Int4PlanesLinear(TritonInt4Linear):
    """A 5- or 6-bit layer as an int4 layer (qweight: the codes' low 4 bits) with a high plane `hi`
    ([out, in * (bits - 4) / 32] int32). One row: the int4 GEMV with the high bits (fp16 inputs
    there multiply as float: packed fp16 takes 4-bit codes only); 2 to MAX_ROWS rows: the int4
    split-K kernel with the high bits (groups of a multiple of 128), else the plane kernel; more:
    dequantized for cuBLAS."""

    def __init__(self, lin: GPTQLinear):
        nn.Module.__init__(self)
        group = lin.in_features if lin.group_size in (-1, 0) else lin.group_size
        codes, zeros = layer_codes(lin.qweight, lin.qzeros, lin.in_features, lin.out_features, lin.bits, lin.v1,
                                   lin.planar)  # [out, in], [groups, out]
        lo, hi = split_planes(whole_groups(codes, zeros, group).contiguous(), lin.bits)  # a short last group filled
        self._set(lo, lin.scales.t().contiguous(), zeros.t().to(torch.uint8).contiguous(), None, group, lin.bias,
                  lin.in_features)
        self.bits = lin.bits
        self.register_buffer("hi", hi)

    @classmethod
    def concat(cls, mods: list["Int4PlanesLinear"]) -> "Int4PlanesLinear | None":
        if any(m.bits != mods[0].bits for m in mods):
            return None
        fused = super().concat(mods)
        if fused is not None:
            fused.bits = mods[0].bits
            fused.register_buffer("hi", torch.cat([m.hi for m in mods]))
        return fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] ([..., 2 in] with glu), residual: [..., out] or None -> [..., out]
        from llamactl.kernels.gemv_int4 import dequantize_int4, gemv_int4
        from llamactl.kernels.multirow import MAX_ROWS, multirow_int4

        inputs, high = "float" if self.inputs == "fp16" else self.inputs, SPLITS[self.bits][1]
        if x.numel() == self._input_width() and self.can_fuse():
            y = gemv_int4(x.reshape(-1), self.qweight, self.scales, self.zeros, self.group_size, *self._norm_args(),
                          None if residual is None else residual.reshape(-1), self.glu, self.glu_out, inputs,
                          self.pdl, self.pins, self.hi, high)
            return y.view(*x.shape[:-1], self._output_width())
        x2 = self._unfused_input(x).reshape(-1, self.in_features)  # [M, in]
        if self.pad:
            x2 = F.pad(x2, (0, self.pad))  # [M, groups * group_size]
        if x2.shape[0] == 1:  # a short last group, or a bias
            y = gemv_int4(x2[0].contiguous(), self.qweight, self.scales, self.zeros, self.group_size, inputs=inputs,
                          pdl=self.pdl, pins=self.pins, high=self.hi, high_bits=high)[None]
        elif x2.shape[0] <= MAX_ROWS:  # a decode batch: the split-K kernel (groups of 128 k) or the planes
            y = multirow_int4(x2, self.qweight, self.scales, self.zeros, self.group_size, self.hi, high)
        else:  # a prefill: dequantized in Triton for cuBLAS
            y = F.linear(x2, dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, x2.dtype, self.hi,
                                             high))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        y = self._unfused_output(y.view(*x.shape[:-1], self.out_features))
        return y if residual is None else residual + y

    def product(self, rows: int) -> str:
        """What multiplies `rows` rows (bench rows name it)."""
        from llamactl.kernels.multirow import MAX_ROWS, splitk_takes

        kernel = "split-K" if splitk_takes(self.group_size) else "planes"
        return f"int{self.bits} " + ("GEMV" if rows == 1 else kernel if rows <= MAX_ROWS else "dequantize + cuBLAS")


def plane_layer(lin: GPTQLinear) -> nn.Module:
    """The Triton layer of a GPTQ layer PlanesLinear.fits: 5 and 6 bits in groups of whole 32-column
    words on the int4 GEMV, the rest on the planes."""
    group = lin.in_features if lin.group_size in (-1, 0) else lin.group_size
    return Int4PlanesLinear(lin) if SPLITS[lin.bits][0] == 4 and group % 32 == 0 else PlanesLinear(lin)


@torch.no_grad()
def use_plane_kernels(model) -> int:
    """Swap every 3/5/6-bit GPTQLinear the plane kernels take; returns how many."""
    names = [name for name, mod in model.named_modules() if PlanesLinear.fits(mod)]
    swap_linears(model, names, plane_layer)
    return len(names)
