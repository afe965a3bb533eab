"""Loader hooks: swap the runtime's nn.Linear modules for quantized ones before weights are assigned."""

from __future__ import annotations

import torch

from llamactl.errors import CheckpointError
from llamactl.quantize.gptq_format import GPTQLinear, swap_linears


def quantized_module_names(art, suffix: str) -> list[str]:
    return sorted(n[: -len(suffix)] for n in art.tensor_index() if n.endswith(suffix))


def gptq_hook(art, model: torch.nn.Module) -> None:
    q = art.quantization
    bits, group = int(q["bits"]), int(q.get("group_size", 128))
    fmt = q.get("checkpoint_format", q.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{art.path}: GPTQ checkpoint_format {fmt!r} is not supported", "use gptq (v1) or gptq_v2")
    if bits not in (2, 4, 8):
        raise CheckpointError(f"{art.path}: {bits}-bit GPTQ is not supported by the runtime", "use 2, 4 or 8 bits")
    names = quantized_module_names(art, ".qweight")
    if not names:
        raise CheckpointError(f"{art.path}: config.json says GPTQ but no tensor ends in .qweight")

    def make(lin: torch.nn.Linear) -> GPTQLinear:
        with torch.device("meta"):
            return GPTQLinear(lin.in_features, lin.out_features, bits, group, lin.bias is not None, v1=fmt == "gptq")

    swap_linears(model, names, make)


def bnb_hook(art, model: torch.nn.Module) -> None:
    from llamactl.quantize.bnb import swap_bnb_linears

    swap_bnb_linears(art, model)
