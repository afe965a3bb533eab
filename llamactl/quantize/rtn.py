"""llamactl's own round-to-nearest quantization, per group, written in the GPTQ format.

The grid follows GPTQ's quantizer so RTN and GPTQ differ only in how codes are chosen:
the range always includes 0; symmetric uses zero point 2^(b-1) and scale 2*absmax/(2^b - 1).
"""

from __future__ import annotations

import torch

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


def quantize_embedding(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                       clip_search: bool = False, v1: bool = True) -> dict[str, torch.Tensor]:
    """weight: [V, D] -> the GPTQ tensors (qweight, qzeros, scales, g_idx) of the table
    (layers.embedding), RTN per group of `group_size` along each row (a shorter last group where
    it does not divide D)."""
    from llamactl.layers.gptq import pack_gptq

    codes, zeros, scales, g_idx = rtn_quantize(weight, bits, group_size, sym, clip_search)
    return pack_gptq(codes, zeros, scales, g_idx, bits, v1=v1)


def write_rtn(art, opts, folder, progress, act2: dict[str, torch.Tensor] | None = None) -> dict:
    """Quantize every tensor `module_schemes` names (the embedding table aside: quantize.stage)
    with RTN and write a GPTQ-format folder. act2: the calibration inputs' mean squares per linear,
    which weight the clipping search (importance-weighted rounding)."""
    import json

    from llamactl import __version__
    from llamactl.folder.artifact import save_weights
    from llamactl.folder.checkpoint import iter_checkpoint
    from llamactl.layers.gptq import PLANES, pack_gptq
    from llamactl.quantize.options import EMBED, module_schemes

    schemes = {n: s for n, s in module_schemes(art, opts).items() if s is not None and n != EMBED}
    planar = any(s["bits"] in PLANES for s in schemes.values())  # GPTQModel writes such files as gptq_p
    state: dict[str, torch.Tensor] = {}
    tensors = dict(iter_checkpoint(art))
    if art.args.tie_word_embeddings and "lm_head" in schemes and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors[f"{EMBED}.weight"]
    with progress("rtn", len(schemes)) as advance:
        for name, t in tensors.items():
            module = name.rsplit(".", 1)[0]
            if module in schemes and name.endswith(".weight"):
                s = schemes[module]
                codes, zeros, scales, g_idx = rtn_quantize(t, s["bits"], s["group_size"], s["sym"], opts.clip_search,
                                                           (act2 or {}).get(module))
                bias = tensors.get(f"{module}.bias")
                for k, v in pack_gptq(codes, zeros, scales, g_idx, s["bits"], bias, v1=not planar, planar=planar).items():
                    state[f"{module}.{k}"] = v
                advance(1)
            elif not (name.endswith(".bias") and name.rsplit(".", 1)[0] in schemes):
                state[name] = t
    save_weights(state, folder)
    engine = {"name": "llamactl-rtn", "version": __version__,
              "checkpoint_format": "gptq_p (planes, zero stored as it is)" if planar else "gptq (v1: stored zero = zero - 1)",
              "scales_dtype": "float16", "clip_search": opts.clip_search, "clip_grid": CLIP_GRID if opts.clip_search else None,
              "importance_weighted": bool(act2) and opts.clip_search,
              "quantized_modules": sorted(schemes), "scheme": f"int{opts.bits} g{opts.group_size} {'sym' if opts.sym else 'asym'}"}
    config = dict(art.config)
    config["quantization_config"] = gptq_config(opts, quantizer=f"llamactl:{__version__}", method="rtn",
                                                schemes=module_schemes(art, opts), planar=planar)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return engine


def gptq_config(opts, quantizer: str, method: str, schemes: dict, planar: bool = False) -> dict:
    """The quantization_config block transformers/optimum read for a GPTQ-format checkpoint;
    schemes (options.module_schemes): the modules whose bits differ go in GPTQModel's `dynamic`;
    planar: 3, 5 or 6 bits somewhere, which GPTQModel stores as its gptq_p format."""
    from llamactl.quantize.options import dynamic_overrides

    q = {
        "quant_method": "gptq", "bits": opts.bits, "group_size": opts.group_size, "desc_act": opts.desc_act,
        "sym": opts.sym, "lm_head": bool(schemes.get("lm_head")),
        "checkpoint_format": "gptq_p" if planar else "gptq", "format": "gptq_p" if planar else "gptq",
        "pack_dtype": "int32", "true_sequential": True, "static_groups": False,
        "meta": {"quantizer": [quantizer], "method": method},
    }
    dynamic = dynamic_overrides(schemes, opts)
    if dynamic:
        q["dynamic"] = dynamic
    return q


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
    from llamactl.layers.int4 import int4_linear, supported, triton_supported

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

    from llamactl.layers.cpu import CpuQuantLinear
    from llamactl.layers.gptq import GPTQLinear, pack_gptq, swap_linears
    from llamactl.layers.planes import PlanesLinear, plane_layer

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
    from llamactl.layers.int8 import Int8Kernel

    n = 0
    for name, mod in _decoder_linears(model, every):
        w = mod.weight.float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Int8Kernel(q, scale, mod.bias, triton))
        n += 1
    return n
