"""The formats the quantize stage writes, by --method: GPTQ's layout (gptq, rtn), bitsandbytes'
(nf4, int8) and compressed-tensors' float-quantized one (fp8). Reading them back is the runtime's (layers.formats, by config.json's quant_method)."""

from __future__ import annotations

from typing import Any, Callable


def _write_rtn(art, opts, folder, device, progress, log, stats):
    from llamactl.quantize.rtn import write_rtn

    return write_rtn(art, opts, folder, progress, stats.act2 if stats else None)


def _write_gptq(art, opts, folder, device, progress, log, stats):
    from llamactl.quantize.gptq import write_gptq

    return write_gptq(art, opts, folder, device, progress, log)


def _write_bnb(art, opts, folder, device, progress, log, stats):
    from llamactl.quantize.bnb import write_bnb

    return write_bnb(art, opts, folder, progress, log)


def _write_fp8(art, opts, folder, device, progress, log, stats):
    from llamactl.quantize.fp8 import write_fp8

    return write_fp8(art, opts, folder, progress)


WRITERS: dict[str, tuple[str, Callable]] = {"gptq": ("gptq", _write_gptq), "rtn": ("gptq", _write_rtn),
                                            "nf4": ("bitsandbytes", _write_bnb), "int8": ("bitsandbytes", _write_bnb),
                                            "fp8": ("compressed-tensors", _write_fp8)}


def write(method: str, art, opts, folder, device, progress, log, stats=None) -> dict[str, Any]:
    """Write `art` quantized by `method` into folder; returns the engine's info. stats:
    quantize.sensitivity's calibration statistics, where the stage has them."""
    return WRITERS[method][1](art, opts, folder, device, progress, log, stats)
