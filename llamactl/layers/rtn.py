"""Round-to-nearest quantization per group (GPTQ's grid: the range always includes 0; symmetric
uses zero point 2^(b-1) and scale 2*absmax/(2^b - 1)), and in-memory models quantized with it
into the runtime's low-bit layers (synthetic shapes: bench, serve). The quantize stage writes
folders with the same math (quantize.rtn)."""

from __future__ import annotations

import torch

from llamactl.layers.cpu import CpuQuantLinear
from llamactl.layers.fp8 import FP8Linear, quantize_fp8, use_fp8_kernels
from llamactl.layers.gptq import GPTQLinear, pack_gptq, swap_linears
from llamactl.layers.int4 import int4_linear, supported, triton_supported
from llamactl.layers.int8 import Int8Kernel
from llamactl.layers.planes import PlanesLinear, plane_layer

CLIP_GRID = torch.linspace(1.0, 0.70, 16).tolist()  # shrink factors tried by the clipping search


def group_params(w: torch.Tensor, bits: int, sym: bool, shrink: float | torch.Tensor = 1.0):
    """w: [out, groups, g] -> scales, zeros: [out, groups] (zeros are integer-valued floats)."""
    maxq = 2**bits - 1
    wmin = (w.amin(dim=-1).clamp(max=0) * shrink)
    wmax = (w.amax(dim=-1).clamp(min=0) * shrink)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        wmin = -wmax
    scale = (wmax - wmin) / maxq
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if sym:
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        # v1 checkpoints store zero - 1, so a zero point of 0 is not representable: keep it >= 1.
        zero = torch.round(-wmin / scale).clamp(1, maxq)
    return scale, zero


def quantize_groups(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [out, groups, g] for w: [out, groups, g] with per-group scale/zero: [out, groups]."""
    return torch.clamp(torch.round(w / scale[..., None]) + zero[..., None], 0, 2**bits - 1)


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool, clip_search: bool = False,
                 col_weight: torch.Tensor | None = None):
    """weight: [out, in] -> (codes [out, in], zeros [groups, out], scales [groups, out], g_idx [in]).

    Any group size works on any width: groups = ceil(in / g), the last one shorter when g does not
    divide the width (GPTQ's g_idx says so; its loaders size scales with the same ceil). The short
    group is padded with zeros while its range is found, which changes nothing: the range always
    includes 0, and a zero weight quantizes to exactly 0.

    With clip_search, each group's range is shrunk by the factor in CLIP_GRID that minimises the
    squared error, weighted per input column by col_weight: [in] (for example the mean squared
    activation of that input) when given.
    """
    out_f, in_f = weight.shape
    g = in_f if group_size in (-1, 0) else min(group_size, in_f)
    groups = -(-in_f // g)
    pad = groups * g - in_f
    w = torch.nn.functional.pad(weight.float(), (0, pad)).view(out_f, groups, g)  # [out, groups, g]
    scale, zero = group_params(w, bits, sym)
    if clip_search:
        cw = torch.ones(in_f) if col_weight is None else col_weight.float()
        cw = torch.nn.functional.pad(cw.to(w.device), (0, pad)).view(1, groups, g)
        best = torch.full(scale.shape, float("inf"), device=w.device)
        for r in CLIP_GRID:
            s, z = group_params(w, bits, sym, r)
            err = (((quantize_groups(w, s, z, bits) - z[..., None]) * s[..., None] - w) ** 2 * cw).sum(-1)
            better = err < best
            best = torch.where(better, err, best)
            scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    scale = scale.half().float()  # the checkpoint stores fp16 scales: round against those
    codes = quantize_groups(w, scale, zero, bits).view(out_f, groups * g)[:, :in_f].to(torch.int32)
    g_idx = torch.arange(in_f, dtype=torch.int32, device=weight.device) // g
    return codes.contiguous(), zero.t().contiguous(), scale.t().contiguous(), g_idx


def _decoder_linears(model, every: bool = False) -> list[tuple[str, "torch.nn.Linear"]]:
    """(name, module) of the plain nn.Linear layers in model's decoder layers (every: all of them)."""
    from torch import nn

    return [(name, mod) for name, mod in model.named_modules()
            if type(mod) is nn.Linear and (every or ".layers." in f".{name}")]


@torch.no_grad()
def quantize_linears_int4(model, triton: bool, group_size: int = 128, sym: bool = True, every: bool = False) -> int:
    """RTN-quantize every decoder linear of an in-memory model to 4 bits (synthetic benchmarks):
    llamactl's int4 layers where `triton`, else tinygemm's where its shapes allow. every: each
    linear of `model`, which is then one decoder layer (synthetic.build_synthetic's `quantize`)."""
    n = 0
    for name, mod in _decoder_linears(model, every):
        fits = triton_supported(mod.in_features, group_size) if triton else supported(
            mod.in_features, mod.out_features, group_size)
        if fits:
            codes, zeros, scales, g_idx = rtn_quantize(mod.weight.float(), 4, group_size, sym)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, int4_linear(codes, zeros, scales, g_idx.to(codes.device),
                                                                    group_size, mod.bias, mod.weight.device, triton))
            n += 1
    return n


@torch.no_grad()
def quantize_linears_planes(model, bits: int, group_size: int, triton: bool, cpu: bool = False,
                            every: bool = False) -> int:
    """RTN-quantize every decoder linear of an in-memory model to `bits` (synthetic benchmarks):
    the plane kernels' layers (3, 5, 6 bits) where `triton`, llamactl's CPU layers where `cpu`
    (any bits; group_size -1: one group a row), else GPTQ layers (dequantized per call). every: as
    quantize_linears_int4's."""
    from torch import nn

    def packed(mod: nn.Linear) -> nn.Module:
        lin = GPTQLinear(mod.in_features, mod.out_features, bits, group_size, bias=False).to(mod.weight.device)
        for k, v in pack_gptq(*rtn_quantize(mod.weight.float(), bits, group_size, True), bits, planar=bits == 3).items():
            setattr(lin, k, v)
        lin.planar = bits == 3
        lin.bias = mod.bias
        if cpu:
            return CpuQuantLinear.from_gptq(lin) or lin
        return plane_layer(lin) if triton and PlanesLinear.fits(lin) else lin

    names = [name for name, _ in _decoder_linears(model, every)]
    swap_linears(model, names, packed)
    return len(names)


@torch.no_grad()
def quantize_linears_int8(model, triton: bool, every: bool = False) -> int:
    """Symmetric per-channel int8 for every decoder linear of an in-memory model (synthetic
    benchmarks); every: as quantize_linears_int4's."""
    n = 0
    for name, mod in _decoder_linears(model, every):
        w = mod.weight.float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Int8Kernel(q, scale, mod.bias, triton))
        n += 1
    return n


def quantize_linears_fp8(model, every: bool = False) -> int:
    """FP8 e4m3 per output channel (quantize.fp8's scheme) for every decoder linear of an in-memory
    model (synthetic benchmarks); every: as quantize_linears_int4's."""
    n = 0
    for name, mod in _decoder_linears(model, every):
        with torch.device("meta"):
            layer = FP8Linear(mod.in_features, mod.out_features, mod.bias is not None)
        layer.weight, layer.weight_scale = quantize_fp8(mod.weight, mod.weight.dtype)
        if mod.bias is not None:
            layer.bias = mod.bias
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        n += 1
    use_fp8_kernels(model)
    return n
