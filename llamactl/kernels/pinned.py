"""Autotune picks pinned per GPU and GEMV shape (LLAMACTL_PIN_CONFIGS=0: tune every shape).

Triton's autotuner times each candidate alone (a 5-25 us kernel, L2 flushed) and its pick for a
shape changes from run to run. Inside the decode step's CUDA graph, with PDL overlapping each
kernel with the one before, the picks differ by more than their lone timings say: with identical
kernels (the same sm_90 SASS), llama2-7b int4 decoded at 452.3 tok/s with run 19's picks and at
385.1-385.6 with run 23's, and int8 at 317.1 (run 18) and 369.9 (run 19) (docs/bench). A shape
listed here for the GPU in use runs the pick of the fastest measured run without tuning; every
other shape is tuned as before, and a pin that is no longer among the candidates is ignored.
`python scripts/pins_from_autotune.py RUN-autotune.txt` prints a run's picks as rows of this table.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from llamactl.env import flag
from llamactl.errors import InputError
from llamactl.kernels import INPUT_SWITCHES, _index

# (N, K, third, NORM, GLU, RESIDUAL, GLU_OUT, PDL, inputs, x dtype) -> the config (inputs: one of
# env.QUANT_INPUTS, see _inputs): `third` is G for the int4 kernel and HAS_SCALE (int8 weights) for
# the 16-bit/int8 one. Each group names its run.
# (NORM, GLU, RESIDUAL, GLU_OUT): qkv and lm_head read a norm; o and down add the residual;
# gate_up reads a norm and gives SwiGLU's output
_NORM, _RES, _GU = (True, False, False, False), (False, False, True, False), (True, False, False, True)
_ON = (True, "float", "bfloat16")  # PDL on, float inputs, bf16 activations
_A8 = (True, "int8", "bfloat16")  # PDL on, int8 inputs
_H16 = (True, "fp16", "bfloat16")  # PDL on, packed fp16 arithmetic
_I16 = (True, "int16", "bfloat16")  # PDL on, int16 inputs


def _cfg(bn: int, bk: int, warps: int, stages: int = 1, prefetch: bool = False, **variant) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "PREFETCH": prefetch, **variant, "num_warps": warps, "num_stages": stages}


_H200 = {
    "gemv": {
        # bf16, llama2-7b: run 23 (280.6 tok/s; 280.7-280.9 in runs 24-25 with these picks from the cache)
        (32000, 4096, False, *_NORM, *_ON): _cfg(4, 1024, 4, REDUCE_EACH=False),  # lm_head (final norm folded)
        (12288, 4096, False, *_NORM, *_ON): _cfg(2, 1024, 4, REDUCE_EACH=False),
        (4096, 4096, False, *_RES, *_ON): _cfg(8, 2048, 8, REDUCE_EACH=False),
        (22016, 4096, False, *_GU, *_ON): _cfg(4, 1024, 4, REDUCE_EACH=False),
        (4096, 11008, False, *_RES, *_ON): _cfg(8, 1024, 4, prefetch=True, REDUCE_EACH=False),
        # bf16, llama3-8b: run 20 (258.1 tok/s, 92.4% of the ceiling); its o_proj is llama2-7b's shape
        (128256, 4096, False, *_NORM, *_ON): _cfg(4, 1024, 4, REDUCE_EACH=False),
        (6144, 4096, False, *_NORM, *_ON): _cfg(4, 1024, 4, REDUCE_EACH=False),
        (28672, 4096, False, *_GU, *_ON): _cfg(4, 1024, 4, REDUCE_EACH=False),
        (4096, 14336, False, *_RES, *_ON): _cfg(4, 2048, 8, REDUCE_EACH=False),
        # int8 weights, float inputs, llama2-7b: run 37's in-graph sweep with the PRMT conversion (409.0
        # tok/s, 1.46x bf16; run 24's picks, tuned for the kernel before it, gave 390.7 = 1.40x in run 40)
        (12288, 4096, True, *_NORM, *_ON): _cfg(16, 256, 4, REDUCE_EACH=False),
        (4096, 4096, True, *_RES, *_ON): _cfg(4, 1024, 4, REDUCE_EACH=False),
        (22016, 4096, True, *_GU, *_ON): _cfg(16, 1024, 4, REDUCE_EACH=True),
        (4096, 11008, True, *_RES, *_ON): _cfg(4, 1024, 4, REDUCE_EACH=False),
        # int8 weights in packed fp16, llama2-7b: run 40's in-graph sweep (444.1 tok/s, 1.59x bf16)
        (12288, 4096, True, *_NORM, *_H16): _cfg(8, 2048, 8, REDUCE_EACH=False),
        (4096, 4096, True, *_RES, *_H16): _cfg(8, 2048, 8, REDUCE_EACH=False),
        (22016, 4096, True, *_GU, *_H16): _cfg(16, 1024, 4, REDUCE_EACH=True),
        (4096, 11008, True, *_RES, *_H16): _cfg(8, 2048, 8, REDUCE_EACH=False),
        # int8 weights, int16 inputs, llama2-7b: run 41's in-graph sweep (each GEMV 4-6% faster than
        # fp16 arithmetic's picks in run 40)
        (12288, 4096, True, *_NORM, *_I16): _cfg(8, 2048, 8, REDUCE_EACH=False),
        (4096, 4096, True, *_RES, *_I16): _cfg(8, 2048, 8, REDUCE_EACH=False),
        (22016, 4096, True, *_GU, *_I16): _cfg(16, 1024, 4, REDUCE_EACH=True),
        (4096, 11008, True, *_RES, *_I16): _cfg(8, 2048, 8, REDUCE_EACH=False),
        # int8 weights, int8 inputs, llama2-7b: run 32's in-graph sweep of every candidate with the
        # 16-column DP4A chains (464.3 tok/s, 1.67x bf16); run 24's picks but for o_proj (was 4 x 1024)
        (12288, 4096, True, *_NORM, *_A8): _cfg(16, 2048, 8, REDUCE_EACH=False),
        (4096, 4096, True, *_RES, *_A8): _cfg(8, 2048, 8, REDUCE_EACH=False),
        (22016, 4096, True, *_GU, *_A8): _cfg(16, 1024, 4, REDUCE_EACH=True),
        (4096, 11008, True, *_RES, *_A8): _cfg(8, 2048, 8, REDUCE_EACH=False),
    },
    "int4": {
        # int4 g128, float inputs, llama2-7b: run 19 (452.3 tok/s; run 23's picks gave 385.1; 450.9 in run 35)
        (12288, 4096, 128, *_NORM, *_ON): _cfg(16, 1024, 2, X_CONTIG=False),
        (4096, 4096, 128, *_RES, *_ON): _cfg(16, 2048, 8, X_CONTIG=True),
        (22016, 4096, 128, *_GU, *_ON): _cfg(16, 1024, 4, X_CONTIG=True),
        (4096, 11008, 128, *_RES, *_ON): _cfg(8, 2048, 4, X_CONTIG=True),
        # int4 g128, int8 inputs, llama2-7b: the autotuner's picks in run 35 (614.5 tok/s, 2.19x bf16)
        (12288, 4096, 128, *_NORM, *_A8): _cfg(16, 2048, 8, X_CONTIG=True),
        (4096, 4096, 128, *_RES, *_A8): _cfg(8, 2048, 4, X_CONTIG=True),
        (22016, 4096, 128, *_GU, *_A8): _cfg(16, 1024, 4, X_CONTIG=True),
        (4096, 11008, 128, *_RES, *_A8): _cfg(8, 2048, 4, X_CONTIG=True),
        # int4 g128, int16 inputs, llama2-7b: the autotuner's picks in run 41 (616.9 tok/s, 2.19x bf16;
        # the in-graph sweep of run 41 chose the same for qkv and o before its time ran out)
        (12288, 4096, 128, *_NORM, *_I16): _cfg(16, 1024, 2, X_CONTIG=True),
        (4096, 4096, 128, *_RES, *_I16): _cfg(8, 2048, 4, X_CONTIG=True),
        (22016, 4096, 128, *_GU, *_I16): _cfg(16, 1024, 2, X_CONTIG=True),
        (4096, 11008, 128, *_RES, *_I16): _cfg(8, 2048, 4, X_CONTIG=True),
        # int4 g128 in packed fp16, llama2-7b: the in-graph sweep of run 36 (566.9 tok/s, 2.02x bf16)
        (12288, 4096, 128, *_NORM, *_H16): _cfg(16, 1024, 2, X_CONTIG=False),
        (4096, 4096, 128, *_RES, *_H16): _cfg(8, 2048, 4, X_CONTIG=False),
        (22016, 4096, 128, *_GU, *_H16): _cfg(16, 1024, 4, X_CONTIG=False),
        (4096, 11008, 128, *_RES, *_H16): _cfg(8, 2048, 4, X_CONTIG=False),
    },
}
TABLE = {"NVIDIA H200": _H200}


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def table(device: torch.device) -> dict:
    """The pins for `device`'s GPU model ({} off CUDA, for other GPUs, or with LLAMACTL_PIN_CONFIGS=0),
    with those of the file LLAMACTL_PINS_FILE over them (see _file_pins)."""
    if device.type != "cuda" or not flag("LLAMACTL_PIN_CONFIGS", True):
        return {}
    pins = TABLE.get(_device_name(_index(device)), {})
    extra = os.environ.get("LLAMACTL_PINS_FILE")
    if not extra:
        return pins
    return {kernel: {**pins.get(kernel, {}), **_file_pins(extra).get(kernel, {})} for kernel in ("gemv", "int4")}


def label(device: torch.device) -> str:
    """What a report says of the pins in use on `device`: ", pinned configs" (plus the pins file
    when LLAMACTL_PINS_FILE adds some), or nothing."""
    if not any(table(device).values()):
        return ""
    extra = os.environ.get("LLAMACTL_PINS_FILE")
    return ", pinned configs" + (f" (and {Path(extra).name})" if extra else "")


@functools.lru_cache(maxsize=None)
def _file_pins(path: str) -> dict:
    """Pins for the GPU in use from a JSON file: [[kernel, key, config], ...], key as in the table
    above (the x dtype without "torch."), config as _cfg's result; to time configs the autotuner
    does not pick, or to pin another GPU's picks (scripts/pins_from_autotune.py prints a run's).
    Files written before the inputs were named (runs 32-40) say false for float and true for int8."""
    pins: dict = {"gemv": {}, "int4": {}}
    try:
        for kernel, key, config in json.loads(Path(path).read_text()):
            if kernel not in pins or len(key) != 10 or not isinstance(config, dict):
                raise ValueError(f"row {[kernel, key, config]}: kernel gemv or int4, a key of 10 values, a config")
            inputs = {False: "float", True: "int8"}.get(key[8], key[8])
            pins[kernel][(*key[:8], inputs, key[9])] = config
    except (OSError, ValueError, TypeError) as e:
        raise InputError(f"LLAMACTL_PINS_FILE={path}: not a readable list of [kernel, key, config] rows ({e})",
                         "fix the file or unset LLAMACTL_PINS_FILE") from e
    return pins


def _matches(config, want: dict) -> bool:
    have = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
    return all(have.get(k) == v for k, v in want.items())


def choose(kernel: str, configs: list, args: dict) -> list:
    """configs, or the one pinned for this launch (kernel: "gemv" or "int4"; args: the launch's
    arguments by name, as an autotuner's prune hook gets them)."""
    x = args["x_ptr"]
    third = args["G"] if kernel == "int4" else args["HAS_SCALE"]
    key = (args["N"], args["K"], third, args["NORM"], args["GLU"], args["RESIDUAL"], args.get("GLU_OUT", False),
           args.get("PDL", False), inputs(args), str(x.dtype).removeprefix("torch."))
    want = table(x.device).get(kernel, {}).get(key)
    pinned = [c for c in configs if want is not None and _matches(c, want)]
    return pinned[:1] or configs


def inputs(args: dict) -> str:
    """What a launch's low-bit GEMV multiplies with (env.QUANT_INPUTS), from its A8/H16/I16 switches."""
    return next((kind for kind, switch in INPUT_SWITCHES.items() if args.get(switch)), "float")
