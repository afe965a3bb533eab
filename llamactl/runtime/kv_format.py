"""What a KV cache stores (`--kv-dtype`): the model's 16-bit values, or 8 bits with a scale.

An 8-bit cache (int8, or fp8 e4m3 where the GPU has it) keeps each position's key (and value) of
each KV head as D 8-bit numbers and one float16 scale, their largest magnitude over the format's:
x ~ q * scale. A scale per position and head is written with the position alone (no block-wide
maximum to revise as a block fills, no calibration), and costs 2 bytes of every D: a cache of
head_dim 128 holds 1.97x the tokens of a 16-bit one in the same memory. Attention reads the 8-bit
numbers and multiplies the scale into its scores (keys) and weights (values), so a kernel pays one
conversion a value for half the bytes (kernels.attention, kernels.prefill_attention); PyTorch
paths dequantize what they gather (`dequantize`). docs/decisions/2026-12-07-kv8.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llamactl.errors import InputError
from llamactl.options import KV_DTYPES
SCALE_DTYPE = torch.float16
_SIXTEEN = {"bf16": torch.bfloat16, "fp16": torch.float16}
_EIGHT = {"int8": (torch.int8, float(torch.iinfo(torch.int8).max)),  # 127
          "fp8": (torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max))}  # 448


@dataclass(frozen=True)
class KVFormat:
    """A cache's values: `storage` dtype, and qmax (the largest 8-bit magnitude) where scaled."""

    name: str
    storage: torch.dtype
    qmax: float | None = None

    @classmethod
    def of(cls, dtype: torch.dtype) -> "KVFormat":
        """A cache of the model's own dtype (named as it: bfloat16, float32)."""
        return cls(str(dtype).replace("torch.", ""), dtype)

    @property
    def quantized(self) -> bool:
        return self.qmax is not None

    def bytes_per_head(self, head_dim: int) -> int:
        """Bytes one position of one KV head takes, K or V (its scale included)."""
        item = torch.empty((), dtype=self.storage).element_size()
        return head_dim * item + (SCALE_DTYPE.itemsize if self.quantized else 0)


def resolve(kv_dtype: str, compute: torch.dtype, device: torch.device | str = "cpu") -> KVFormat:
    """The format `--kv-dtype` names for a model computing in `compute` on `device`; InputError
    where it cannot run there. auto: the model's dtype (16-bit, or float32 on the CPU)."""
    device = torch.device(device)
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"--kv-dtype {kv_dtype!r} is not a KV cache format", f"use one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        return KVFormat.of(compute)
    if kv_dtype in _SIXTEEN:
        if _SIXTEEN[kv_dtype] != compute:
            raise InputError(f"--kv-dtype {kv_dtype} with a {str(compute).replace('torch.', '')} model: a 16-bit "
                             "cache holds the model's own dtype",
                             f"pass --kv-dtype auto, or --dtype {str(_SIXTEEN[kv_dtype]).replace('torch.', '')}")
        return KVFormat(kv_dtype, compute)
    if kv_dtype == "fp8" and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise InputError(f"--kv-dtype fp8 needs a GPU with FP8 (compute capability 8.9 or later; {name} is not one)",
                         "pass --kv-dtype int8")
    storage, qmax = _EIGHT[kv_dtype]
    return KVFormat(kv_dtype, storage, qmax)


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (8-bit values [..., D] in fmt.storage, scales [...] float16): x ~ q * scale.
    On the CPU, once llamactl's CPU kernels are loaded, in one pass of theirs (the same numbers)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        from llamactl.kernels import cpu  # (a model's plan loads them; nothing is built here)

        if cpu.loaded():
            return torch.ops.llamactl_cpu.kv_quantize(x.detach().contiguous(), fmt.storage == torch.int8)
    return quantize_reference(x, fmt)


def quantize_reference(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize in PyTorch's operators (any device; what the kernels' own quantization matches)."""
    amax = x.detach().abs().amax(-1).float()  # [...]
    scale = (amax / fmt.qmax).clamp(min=2.0**-24, max=65504.0).to(SCALE_DTYPE)
    y = x.float() / scale.float()[..., None]
    if fmt.storage == torch.int8:
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-fmt.qmax, fmt.qmax).to(fmt.storage), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize's inverse: q [..., D], scale [...] -> [..., D] in dtype."""
    return (q.float() * scale.float()[..., None]).to(dtype)
