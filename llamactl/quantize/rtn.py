"""llamactl's own round-to-nearest quantization written in the GPTQ format (the math: layers.rtn,
GPTQ's grid, so RTN and GPTQ differ only in how codes are chosen)."""

from __future__ import annotations

import torch

from llamactl import __version__
from llamactl.folder.artifact import save_weights
from llamactl.folder.checkpoint import iter_checkpoint
from llamactl.layers.gptq import PLANES, pack_gptq
from llamactl.layers.rtn import CLIP_GRID, group_params, quantize_groups, rtn_quantize  # noqa: F401
from llamactl.quantize.options import EMBED, dynamic_overrides, module_schemes


def quantize_embedding(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                       clip_search: bool = False, v1: bool = True) -> dict[str, torch.Tensor]:
    """weight: [V, D] -> the GPTQ tensors (qweight, qzeros, scales, g_idx) of the table
    (layers.embedding), RTN per group of `group_size` along each row (a shorter last group where
    it does not divide D)."""
    codes, zeros, scales, g_idx = rtn_quantize(weight, bits, group_size, sym, clip_search)
    return pack_gptq(codes, zeros, scales, g_idx, bits, v1=v1)


def write_rtn(art, opts, folder, progress, act2: dict[str, torch.Tensor] | None = None) -> dict:
    """Quantize every tensor `module_schemes` names (the embedding table aside: quantize.stage)
    with RTN and write a GPTQ-format folder. act2: the calibration inputs' mean squares per linear,
    which weight the clipping search (importance-weighted rounding)."""
    import json

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
