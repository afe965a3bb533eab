"""3-, 5- and 6-bit linear layers on the packed kernels of kernels.planes.

A GPTQ-format layer of these widths (quantize --target-bpw writes them; GPTQModel's planar format
for 5 and 6 bits, its continuous one for 3) is re-laid out at load into two bit planes per output
row. Up to kernels.planes.MAX_ROWS rows run the Triton kernel, which reads the packed weight
once; more rows (a prefill) dequantize it for cuBLAS. Where Triton cannot run (the CPU without
its interpreter), the layer stays a GPTQLinear, which dequantizes on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llamactl.layers.gptq import GPTQLinear, layer_codes, pack_rows, swap_linears, unpack_rows

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


@torch.no_grad()
def use_plane_kernels(model) -> int:
    """Swap every 3/5/6-bit GPTQLinear the plane kernels take; returns how many."""
    names = [name for name, mod in model.named_modules() if PlanesLinear.fits(mod)]
    swap_linears(model, names, PlanesLinear)
    return len(names)
