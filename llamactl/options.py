"""The runtime's choices as one typed object, and the one place LLAMACTL_* variables are read.

A command builds `RuntimeOptions` from its flags over `RuntimeOptions.from_env()` (the variables
are defaults only); core code takes the object as an argument. Nothing sets os.environ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from llamactl.errors import InputError
from llamactl.kernels.arith import QUANT_INPUTS

SWIGLU_SITES = ("gate_up", "down")
KV_DTYPES = ("auto", "bf16", "fp16", "fp8", "int8")  # the KV cache's formats (runtime.kv_format)
CHUNKS = tuple(2**i for i in range(4, 15))  # the decode attention's smallest chunk: 16 .. 16384


@dataclass(frozen=True)
class RuntimeOptions:
    """What the decode step should run; `layers.prepare` turns it into a Plan of what does run.

    kernels: llamactl's Triton kernels where they run (CUDA with Triton), else cuBLAS/SDPA.
    pdl: programmatic dependent launch between the kernels (Hopper and later).
    quant_inputs: what the int4/int8 GEMVs multiply with (float, int8, fp16, int16).
    swiglu: which kernel applies the MLP's SwiGLU (gate_up_proj's output or down_proj's input).
    attn_min_chunk: the split-KV decode attention's smallest chunk of the cache.
    pins: run the tuned configs of kernels/configs/ for this GPU instead of autotuning.
    pins_file: more pinned configs (a file `llamactl bench --tune` wrote) over the packaged ones.
    compile_regions: torch.compile one decoder layer and reuse it (None: no; see decode.compile_regions).
    kv_dtype: what the KV cache stores (KV_DTYPES; runtime.kv_format): auto is the model's dtype.
    mma: int4, int8 and FP8 layers multiply 2-64 rows on the tensor-core kernel (kernels.mma), not
    the skinny / split-K / multirow kernels or scaled_mm (an experiment of issues 51 and 53, off
    until measured: it keeps a second copy of the codes).
    """

    kernels: bool = True
    pdl: bool = True
    quant_inputs: str = "int16"
    swiglu: str = "gate_up"
    attn_min_chunk: int = 64
    pins: bool = True
    pins_file: str | None = None
    compile_regions: bool | None = None
    kv_dtype: str = "auto"
    mma: bool = False

    def __post_init__(self):
        if self.quant_inputs not in QUANT_INPUTS:
            raise InputError(f"quant inputs {self.quant_inputs!r} are not one of {', '.join(QUANT_INPUTS)}",
                             f"use {' or '.join(QUANT_INPUTS)}")
        if self.swiglu not in SWIGLU_SITES:
            raise InputError(f"SwiGLU site {self.swiglu!r} is not one of {', '.join(SWIGLU_SITES)}",
                             "use gate_up or down")
        if self.kv_dtype not in KV_DTYPES:
            raise InputError(f"--kv-dtype {self.kv_dtype!r} is not a KV cache format", f"use one of {', '.join(KV_DTYPES)}")
        if self.attn_min_chunk not in CHUNKS:
            raise InputError(f"attention chunk {self.attn_min_chunk} is not a power of two from 16 to 16384",
                             "use 64 (the default), 128, ...")

    def replace(self, **changes) -> "RuntimeOptions":
        """A copy with `changes`; None values leave a field as it is."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "RuntimeOptions":
        """The defaults, with the LLAMACTL_* variables of `environ` (os.environ) over them. A value
        that is not one of a variable's choices is refused: a typo such as `on` would otherwise
        silently mean off."""
        env = os.environ if environ is None else environ
        return cls(
            kernels=_flag(env, "LLAMACTL_KERNELS", True),
            pdl=_flag(env, "LLAMACTL_PDL", True),
            quant_inputs=_choice(env, "LLAMACTL_QUANT_INPUTS", QUANT_INPUTS) or "int16",
            pins=_flag(env, "LLAMACTL_PIN_CONFIGS", True),
            pins_file=env.get("LLAMACTL_PINS_FILE") or None,
        )

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# the variables from_env reads (each has a flag too). swiglu, attn_min_chunk and compile_regions
# were experiments, decided (docs/bench/README.md), mma is one (scripts/mma_probe.py):
# arguments for library users and tests only.
VARIABLES = ("LLAMACTL_KERNELS", "LLAMACTL_PDL", "LLAMACTL_QUANT_INPUTS", "LLAMACTL_PIN_CONFIGS", "LLAMACTL_PINS_FILE")


def _flag(env, name: str, default: bool | None) -> bool | None:
    value = env.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        raise InputError(f"{name}={value!r} is not 0 or 1", f"set {name}=1 (on) or {name}=0 (off), or unset it")
    return value == "1"


def _choice(env, name: str, allowed: tuple[str, ...]) -> str | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    if value not in allowed:
        raise InputError(f"{name}={value!r} is not one of {', '.join(allowed)}", f"use {' or '.join(allowed)}, or unset it")
    return value


def debug(environ: dict[str, str] | None = None) -> bool:
    """LLAMACTL_DEBUG: the error boundary shows tracebacks for known errors too."""
    return bool((os.environ if environ is None else environ).get("LLAMACTL_DEBUG"))


API_KEY_VARIABLE = "LLAMACTL_API_KEY"


def api_key(environ: dict[str, str] | None = None) -> str | None:
    """LLAMACTL_API_KEY: the bearer token `serve` requires when --api-key is not given (a secret
    kept off the command line, where other users of the machine can read it)."""
    return (os.environ if environ is None else environ).get(API_KEY_VARIABLE) or None
