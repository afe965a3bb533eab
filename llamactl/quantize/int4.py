"""int4 weight-only matmuls: llamactl's Triton kernels on CUDA, PyTorch's tinygemm elsewhere.

On CUDA with Triton, 4-bit layers become kernels.linear.TritonInt4Linear (a GEMV that reads the
4-bit codes near memory bandwidth at batch 1). Otherwise they use PyTorch's tinygemm kernels
(`_weight_int4pack_mm`), which the rest of this docstring describes.

GPTQ/RTN checkpoints are repacked at load: tinygemm computes w = (q - 8) * scale + zero per group
of consecutive input columns, so a GPTQ group with zero point z and scale s becomes
scale = s, zero = (8 - z) * s. Act-order checkpoints (g_idx not monotone) are handled by sorting
the input columns by group once, and gathering the activations in that order at run time.
CUDA takes the codes packed two per byte (even column in the high nibble, checked on an H200 with
torch 2.11); the CPU kernel takes them unpacked as int32.
"""

from __future__ import annotations

import torch
from torch import nn

INNER_K_TILES = 8


def supported(in_features: int, out_features: int, group_size: int) -> bool:
    return (in_features % (INNER_K_TILES * 16) == 0 and out_features % 8 == 0
            and group_size in (32, 64, 128, 256) and in_features % group_size == 0)


def triton_supported(in_features: int, group_size: int) -> bool:
    return in_features % 32 == 0 and group_size % 32 == 0 and in_features % group_size == 0


def _use_triton(device: torch.device) -> bool:
    from llamactl import kernels

    return kernels.on_gpu(device)


def sort_by_group(codes: torch.Tensor, g_idx: torch.Tensor, group_size: int):
    """codes: [out, in], g_idx: [in] -> (codes with columns in group order, perm [in] or None)."""
    g = g_idx.long()
    if torch.equal(g, torch.arange(g.numel(), device=g.device) // group_size):
        return codes, None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], torch.arange(g.numel(), device=g.device) // group_size):
        raise ValueError("g_idx groups are not all of group_size columns")
    return codes[:, perm], perm


def int4_linear(codes, zeros, scales, g_idx, group_size: int, bias, device: torch.device) -> nn.Module:
    """The fastest 4-bit layer for `device` from GPTQ-style codes [out, in], zeros/scales [groups, out]."""
    if _use_triton(device):
        from llamactl.kernels.linear import TritonInt4Linear

        codes, perm = sort_by_group(codes, g_idx, group_size)
        return TritonInt4Linear(codes, zeros, scales, perm, group_size, bias, device)
    q, sz, perm = tinygemm_params(codes, zeros, scales, g_idx, group_size)
    return Int4Linear(q, sz, perm, group_size, bias, device)


def tinygemm_params(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    group_size: int):
    """codes: [out, in], zeros/scales: [groups, out], g_idx: [in] ->
    (q [out, in] int32 in group order, scales_and_zeros [groups, out, 2] float32, perm [in] or None)."""
    codes, perm = sort_by_group(codes, g_idx, group_size)
    scale = scales.float()
    zero = (8 - zeros.float()) * scale
    return codes.to(torch.int32).contiguous(), torch.stack([scale, zero], dim=-1).contiguous(), perm


def dequantize_tinygemm(q: torch.Tensor, sz: torch.Tensor, perm: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The float weight [out, in] in the checkpoint's column order (the reference for tests)."""
    n, k = q.shape
    w = (q.view(n, k // group_size, group_size).float() - 8) * sz[..., 0].t()[:, :, None] + sz[..., 1].t()[:, :, None]
    w = w.view(n, k)
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


class Int4Linear(nn.Module):
    """y = x W^T with W in 4 bits, groups along the input dimension, bf16 activations."""

    def __init__(self, q, sz, perm, group_size: int, bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self.register_buffer("weight_packed", pack(q, device))
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=torch.bfloat16))
        self.register_buffer("perm", None if perm is None else perm.to(device))
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=torch.bfloat16), requires_grad=False)
        self._mm = (torch.ops.aten._weight_int4pack_mm if device.type == "cuda"
                    else torch.ops.aten._weight_int4pack_mm_for_cpu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.perm is not None:
            x2 = x2[:, self.perm]
        y = self._mm(x2, self.weight_packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(dtype)

    @classmethod
    def from_gptq(cls, lin, group_size: int) -> "Int4Linear":
        q, sz, perm = tinygemm_params(*_gptq_codes(lin), lin.g_idx, _group(lin, group_size))
        return cls(q, sz, perm, _group(lin, group_size), lin.bias, lin.qweight.device)


def _group(lin, group_size: int) -> int:
    return group_size if group_size > 0 else lin.in_features


def _gptq_codes(lin):
    """A 4-bit GPTQLinear -> (codes [out, in], zeros [groups, out], scales [groups, out])."""
    from llamactl.quantize.gptq_format import unpack_rows

    codes = unpack_rows(lin.qweight, 4).t()  # [out, in]
    zeros = unpack_rows(lin.qzeros.t().contiguous(), 4).t()  # [groups, out]
    if lin.v1:
        zeros = (zeros + 1) & 0xF
    return codes, zeros, lin.scales


@torch.no_grad()
def use_int4_kernels(model, group_size: int) -> int:
    """Swap every 4-bit GPTQLinear a kernel supports for a fast int4 layer; returns how many."""
    from llamactl.quantize.gptq_format import GPTQLinear

    swapped = 0
    for name, mod in list(model.named_modules()):
        if not (isinstance(mod, GPTQLinear) and mod.bits == 4):
            continue
        g, device = _group(mod, group_size), mod.qweight.device
        ok = triton_supported(mod.in_features, g) if _use_triton(device) else supported(mod.in_features, mod.out_features, g)
        if ok:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, int4_linear(*_gptq_codes(mod), mod.g_idx, g, mod.bias, device))
            swapped += 1
    return swapped


@torch.no_grad()
def quantize_linears_int4(model, group_size: int = 128, sym: bool = True) -> int:
    """RTN-quantize every decoder linear of an in-memory model to Int4Linear (synthetic benchmarks)."""
    from llamactl.quantize.rtn import rtn_quantize

    n = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is nn.Linear and ".layers." in f".{name}" and supported(mod.in_features, mod.out_features, group_size):
            codes, zeros, scales, g_idx = rtn_quantize(mod.weight.float(), 4, group_size, sym)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, int4_linear(codes, zeros, scales, g_idx.to(codes.device),
                                                                    group_size, mod.bias, mod.weight.device))
            n += 1
    return n
