"""NF4 and LLM.int8 through bitsandbytes and transformers, and the runtime's readers for them.

bitsandbytes 0.50.2 on the CPU re-lays an NF4 layer's `weight.absmax` (one float per 64-weight
block) out in place, as a transposed [blocks per row, rows] tensor, at the layer's first forward
(seen on a bf16 model); a model saved after that reloads with wrong weights (logits off by 7.6 on
the trained model). llamactl saves before any forward, rewrites any 2-D absmax flat and in block
order, then reloads the folder with transformers and refuses to write it unless the logits match
the in-memory model.

The runtime reads both formats without bitsandbytes: NF4 codes are looked up in the stored
16-value quant_map and scaled by their block's absmax; int8 rows are scaled by SCB / 127.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llamactl.errors import CheckpointError

ROUND_TRIP_ATOL = 1e-3


def write_bnb(art, opts, folder: Path, progress, log) -> dict[str, Any]:
    import bitsandbytes
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from llamactl.load import checkpoint_dtype

    compute = checkpoint_dtype(art)
    if opts.method == "nf4":
        cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                                 bnb_4bit_use_double_quant=False, llm_int8_skip_modules=["lm_head"])
    else:
        cfg = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=["lm_head"])
    with progress(f"bitsandbytes {opts.method}", 3) as advance:
        model = AutoModelForCausalLM.from_pretrained(str(art.path), quantization_config=cfg, device_map="cpu",
                                                     dtype=compute)
        advance(1)
        # Save before any forward: on the CPU, bitsandbytes' first NF4 forward re-lays absmax out in place.
        model.save_pretrained(str(folder))
        if opts.method == "nf4":
            _fix_absmax(folder)
        probe = torch.arange(1, 65).view(1, 64) % art.args.vocab_size
        with torch.no_grad():
            before = model(probe).logits.float()
        advance(1)
        reloaded = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu", dtype=compute)
        with torch.no_grad():
            diff = (reloaded(probe).logits.float() - before).abs().max().item()
        advance(1)
    if diff > ROUND_TRIP_ATOL:
        raise CheckpointError(
            f"the saved {opts.method} checkpoint reloads with different logits (max |diff| {diff:.3g}); nothing was written",
            "this bitsandbytes version saves a format llamactl cannot repair: try --method gptq or rtn",
        )
    names = sorted(n for n, m in model.named_modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt"))
    return {"name": "bitsandbytes", "version": bitsandbytes.__version__, "via": "transformers BitsAndBytesConfig",
            "quant_type": opts.method, "blocksize": 64 if opts.method == "nf4" else None,
            "double_quant": False, "compute_dtype": str(compute).replace("torch.", ""),
            "llm_int8_threshold": cfg.llm_int8_threshold if opts.method == "int8" else None,
            "absmax_rewritten_in_block_order": opts.method == "nf4",
            "round_trip_max_logit_diff": diff, "quantized_modules": names}


def _fix_absmax(folder: Path) -> None:
    """Rewrite every NF4 absmax flat and in block order (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    for f in sorted(folder.glob("*.safetensors")):
        sd = load_file(str(f))
        changed = False
        for k, v in sd.items():
            if k.endswith(".weight.absmax") and v.dim() == 2:
                sd[k] = v.t().reshape(-1).float().contiguous()
                changed = True
        if changed:
            save_file(sd, str(f), metadata={"format": "pt"})


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
    from llamactl.quantize.gptq_format import swap_linears

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
