"""The options and arguments the commands share, and their checks (a bad value is a usage error, exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llamactl.errors import InputError
from llamactl.kernels.arith import QUANT_INPUTS
from llamactl.options import KV_DTYPES, RuntimeOptions


def check_device(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise typer.BadParameter(f"{value!r} is not a device; use auto, cpu, cuda or cuda:N")


def check_dtype(value: str) -> str:
    if value in ("auto", "float32", "bfloat16", "float16"):
        return value
    raise typer.BadParameter(f"{value!r} is not a dtype; use auto, float32, bfloat16 or float16")


# Shared option types.
ModelArg = Annotated[Optional[str], typer.Argument(
    help="Model folder (Hugging Face format, with or without a llamactl manifest); `embedded` or none: the embedded model.",
    show_default=False, metavar="MODEL")]
ModelReq = Annotated[str, typer.Argument(help="Model folder (Hugging Face format); `embedded`: the embedded model.",
                                         metavar="MODEL")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.", callback=check_device)]
DtypeOpt = Annotated[str, typer.Option("--dtype", callback=check_dtype,
    help="auto, float32, bfloat16 or float16; auto = the checkpoint's on a GPU; on the CPU bfloat16 where its AVX-512 BF16 kernels build (and for GPTQ checkpoints), else float32 for models under 2B parameters.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of tables.")]
TpOpt = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel processes: the model split over N GPUs (or CPU processes); started here, or by torchrun --nproc-per-node N.")]
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="Allow .bin/.pth weights (loaded with weights_only=True).")]
TrustCacheOpt = Annotated[bool, typer.Option("--trust-compile-cache", help="Load a model folder's compile cache (native code) even when it was not built by this user on this machine.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")]
OutOpt = Annotated[str, typer.Option("--output", "-o", help="Output folder (written atomically).")]
QuantInputsOpt = Annotated[Optional[str], typer.Option("--quant-inputs", callback=lambda v: check_quant_inputs(v), help="What the int4/int8 GEMVs multiply with (GPU kernels): float, int8 (rounded per 32 columns, DP4A: faster, a little less exact), fp16 (packed fp16 arithmetic, x exact), or int16 (16-bit fixed point per 32 columns, DP2A: sums exact) (default: LLAMACTL_QUANT_INPUTS, else int16).")]
KernelsOpt = Annotated[Optional[str], typer.Option("--kernels", callback=lambda v: check_on_off("--kernels", v), help="llamactl's Triton kernels on the GPU: on or off (cuBLAS/SDPA) (default: LLAMACTL_KERNELS, else on).")]
PinsFileOpt = Annotated[Optional[str], typer.Option("--pins-file", help="Pinned kernel configs to run over the packaged ones (a file `llamactl bench --tune` wrote) (default: LLAMACTL_PINS_FILE).")]
KvDtypeOpt = Annotated[Optional[str], typer.Option("--kv-dtype", callback=lambda v: check_kv_dtype(v), help="What the KV cache stores: auto (the model's dtype), bf16, fp16, fp8 (e4m3; GPUs with FP8) or int8 (8 bits and a scale per position and head: nearly twice the tokens in the same memory, and less to read a step) [default: auto].", show_default=False)]
EvalOpt = Annotated[Optional[str], typer.Option("--eval", help="Plain-text file for the quality report (default: packaged docs-eval.txt).")]
EvalTokensOpt = Annotated[Optional[int], typer.Option("--eval-tokens", min=0, help="Tokens scored in the quality report; 0 skips it [default: 32,768 on a GPU; on the CPU what takes about 2 minutes for the model, 2,048 to 32,768].", show_default=False)]


def check_quant_inputs(value: str | None) -> str | None:
    if value is not None and value not in QUANT_INPUTS:
        raise typer.BadParameter(f"{value!r}: use {', '.join(QUANT_INPUTS[:-1])} or {QUANT_INPUTS[-1]}")
    return value


def check_kv_dtype(value: str | None) -> str | None:
    if value is not None and value not in KV_DTYPES:
        raise typer.BadParameter(f"{value!r}: use {', '.join(KV_DTYPES[:-1])} or {KV_DTYPES[-1]}")
    return value


def check_on_off(option: str, value: str | None) -> str | None:
    if value is not None and value not in ("on", "off"):
        raise typer.BadParameter(f"{value!r}: use on or off")
    return value


def int_list(option: str, value: str) -> list[int]:
    """A comma list of positive integers (a malformed one is a usage error, exit 2)."""
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma list of integers; for example {option} 128,2048")
    if not out or min(out) < 1:
        raise typer.BadParameter(f"{value!r} needs positive integers; for example {option} 128,2048")
    return out


def runtime_options(kernels: str | None = None, pdl: str | None = None, quant_inputs: str | None = None,
                     pins_file: str | None = None, kv_dtype: str | None = None):
    """The run's RuntimeOptions: the flags given, over the LLAMACTL_* variables, over the defaults."""
    on = {"on": True, "off": False, None: None}
    options = RuntimeOptions.from_env().replace(kernels=on[kernels], pdl=on[pdl], quant_inputs=quant_inputs,
                                                pins_file=pins_file, kv_dtype=kv_dtype)
    if options.pins_file is not None and not Path(options.pins_file).is_file():
        where = "--pins-file" if pins_file is not None else "LLAMACTL_PINS_FILE"
        raise InputError(f"{where} {options.pins_file}: no such file", "write one with `llamactl bench --tune FILE`")
    return options


def comma_choices(option: str, value: str | None, choices: dict, hint: str) -> tuple:
    """A comma list of `choices`' keys as their values; (None,) when the option was not given."""
    if value is None:
        return (None,)
    if not value or any(part not in choices for part in value.split(",")):
        raise typer.BadParameter(f"{option} {value!r}: use {hint}")
    return tuple(choices[part] for part in value.split(","))
