"""The runtime's readers of bitsandbytes checkpoints (NF4 and LLM.int8), without bitsandbytes:
NF4 codes are looked up in the stored 16-value quant_map and scaled by their block's absmax;
int8 rows are scaled by SCB / 127."""

from __future__ import annotations

import json

import torch
from torch import nn

from llamactl.errors import CheckpointError
from llamactl.layers.gptq import swap_linears


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor, shape, blocksize: int):
    """packed: uint8 [n/2, 1] (two codes a byte, high nibble first) -> float weight [out, in]."""
    b = packed.reshape(-1)
    codes = torch.stack(((b >> 4) & 0xF, b & 0xF), dim=-1).reshape(-1).long()  # [n]
    vals = quant_map.float()[codes].view(-1, blocksize) * absmax.float().reshape(-1, 1)  # [blocks, blocksize]
    return vals.reshape(shape)


class NF4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, blocksize: int = 64):
        super().__init__()
        n = in_features * out_features
        self.in_features, self.out_features, self.blocksize = in_features, out_features, blocksize
        self.register_buffer("weight", torch.zeros(n // 2, 1, dtype=torch.uint8))
        self.register_buffer("weight_absmax", torch.zeros(n // blocksize, dtype=torch.float32))
        self.register_buffer("weight_quant_map", torch.zeros(16, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def dequantized(self, dtype):
        w = dequantize_nf4(self.weight, self.weight_absmax, self.weight_quant_map,
                           (self.out_features, self.in_features), self.blocksize)
        return w.to(dtype)

    def forward(self, x):
        return nn.functional.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class Int8Linear(nn.Module):
    """LLM.int8 weights (int8 rows with per-row absmax SCB), computed weight-only."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("SCB", torch.zeros(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def dequantized(self, dtype):
        return (self.weight.float() * (self.SCB.float()[:, None] / 127.0)).to(dtype)

    def forward(self, x):
        return nn.functional.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


# Checkpoint tensor suffix -> runtime buffer name, per module.
NF4_RENAMES = {".weight.absmax": ".weight_absmax", ".weight.quant_map": ".weight_quant_map"}
NF4_DROPPED = (".weight.quant_state.bitsandbytes__nf4", ".weight.quant_state.bitsandbytes__fp4")
INT8_DROPPED = (".weight_format",)


def swap_bnb_linears(art, model: nn.Module) -> None:
    index = art.tensor_index()
    q = art.quantization
    if q.get("load_in_4bit"):
        if q.get("bnb_4bit_quant_type", "nf4") != "nf4" or q.get("bnb_4bit_use_double_quant"):
            raise CheckpointError(f"{art.path}: only plain NF4 (no double quantization) is supported by the runtime")
        names = sorted(n[: -len(".weight.quant_map")] for n in index if n.endswith(".weight.quant_map"))
        blocksize = 64
        state_key = next((n for n in index if n.endswith(NF4_DROPPED[0])), None)
        if state_key:
            from safetensors import safe_open

            with safe_open(str(art.path / index[state_key]["file"]), framework="pt") as fh:
                blocksize = int(json.loads(bytes(fh.get_tensor(state_key).tolist()))["blocksize"])
        absmax = next((index[n] for n in index if n.endswith(".weight.absmax")), None)
        if absmax is not None and len(absmax["shape"]) != 1:
            raise CheckpointError(f"{art.path}: NF4 absmax is stored {absmax['shape']} (bitsandbytes' transposed save)",
                                  "re-quantize it with `llamactl quantize --method nf4`, which writes it in block order")

        def make(lin):
            with torch.device("meta"):
                return NF4Linear(lin.in_features, lin.out_features, lin.bias is not None, blocksize)
    elif q.get("load_in_8bit"):
        names = sorted(n[: -len(".SCB")] for n in index if n.endswith(".SCB"))

        def make(lin):
            with torch.device("meta"):
                return Int8Linear(lin.in_features, lin.out_features, lin.bias is not None)
    else:
        raise CheckpointError(f"{art.path}: bitsandbytes config is neither 4-bit nor 8-bit")
    swap_linears(model, names, make)


def rename_bnb_key(name: str) -> str | None:
    """Map a bitsandbytes checkpoint key to the runtime's buffer name; None drops it."""
    if name.endswith(NF4_DROPPED) or name.endswith(INT8_DROPPED):
        return None
    for old, new in NF4_RENAMES.items():
        if name.endswith(old):
            return name[: -len(old)] + new
    return name
