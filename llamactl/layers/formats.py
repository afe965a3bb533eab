"""Quantized folders at load time: config.json's quant_method -> the modules swapped in on the meta
device, the checkpoint's tensor names, the fast layers put in place after loading. Writing a
format is the offline quantize stage's (quantize.formats)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from llamactl.errors import CheckpointError
from llamactl.folder.schemes import embedding_scheme_of, module_scheme
from llamactl.layers.bnb import rename_bnb_key, swap_bnb_linears
from llamactl.layers.cpu import use_cpu_kernels
from llamactl.layers.embedding import QuantEmbedding
from llamactl.layers.fp8 import FP8Linear, use_fp8_kernels
from llamactl.layers.gptq import BITS, GPTQLinear, swap_linears
from llamactl.layers.int4 import use_int4_kernels
from llamactl.layers.int8 import use_int8_kernels
from llamactl.layers.planes import PLANE_BITS, use_plane_kernels


@dataclass(frozen=True)
class Format:
    quant_method: str  # config.json's quantization_config.quant_method
    swap: Callable  # (artifact, model on the meta device) -> None: quantized modules in place of nn.Linear
    rename: Callable[[str], str | None]  # checkpoint tensor name -> the runtime's (None: dropped)
    finish: Callable  # (artifact, model, dtype, kernels) -> labels: fast layers in place of the portable ones
    # (kernels: layers.plan.linear_kernels, "triton", "cpu" or "torch")


def _gptq_swap(art, model) -> None:
    q = art.quantization
    bits, group = int(q["bits"]), int(q.get("group_size", 128))
    fmt = q.get("checkpoint_format", q.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2", "gptq_p"):
        raise CheckpointError(f"{art.path}: GPTQ checkpoint_format {fmt!r} is not supported",
                              "use gptq (v1), gptq_v2 or gptq_p")
    if bits not in BITS:
        raise CheckpointError(f"{art.path}: {bits}-bit GPTQ is not supported by the runtime",
                              f"use {', '.join(map(str, BITS))} bits")
    names = sorted(n[: -len(".qweight")] for n in art.tensor_index() if n.endswith(".qweight"))
    if not names:
        raise CheckpointError(f"{art.path}: config.json says GPTQ but no tensor ends in .qweight")
    if "model.embed_tokens" in names:
        names.remove("model.embed_tokens")
        _swap_embedding(art, model, fmt == "gptq")

    for name in names:
        b, g = module_scheme(q, name, bits, group)
        if b not in BITS:
            raise CheckpointError(f"{art.path}: {name} is {b}-bit (quantization_config.dynamic), which the runtime "
                                  "does not read", f"use {', '.join(map(str, BITS))} bits")
        with torch.device("meta"):
            swap_linears(model, [name], lambda lin: GPTQLinear(lin.in_features, lin.out_features, b, g,
                                                               lin.bias is not None, v1=fmt == "gptq",
                                                               planar=fmt == "gptq_p"))


def embedding_scheme(art) -> dict | None:
    """{"bits", "group_size", ...} of a low-bit embedding table (quantize --embed-bits), or None."""
    return embedding_scheme_of(art.quantization or {})


def _swap_embedding(art, model, v1: bool) -> None:
    scheme = embedding_scheme(art)
    if not scheme or int(scheme.get("bits", 0)) not in (4, 8):
        raise CheckpointError(f"{art.path}: model.embed_tokens is packed but quantization_config.meta.embed_tokens "
                              "does not say its bits (4 or 8)", "re-quantize the parent with llamactl quantize --embed-bits")
    a = art.args
    with torch.device("meta"):
        model.model.embed_tokens = QuantEmbedding(a.vocab_size, a.hidden_size, int(scheme["bits"]),
                                                  int(scheme.get("group_size", -1)), v1)


def _gptq_finish(art, model, dtype: torch.dtype, kernels: str) -> list[str]:
    """On the CPU with llamactl's kernels: every 2- to 8-bit layer on them (any dtype). Else bf16
    compute: 4-bit layers on llamactl's int4 GEMV (triton) or PyTorch's tinygemm instead of
    dequantizing per call; 8-bit layers with one group per row on the int8 kernels. A low-bit
    embedding table looks rows up in the runtime's dtype."""
    emb = model.model.embed_tokens
    if not isinstance(emb, torch.nn.Embedding):
        emb.dtype = dtype
    done = []
    if kernels == "cpu" and use_cpu_kernels(model):
        done.append("llamactl cpu")
    if dtype != torch.bfloat16:
        return done
    q = art.quantization
    triton = kernels == "triton"
    if use_int4_kernels(model, int(q.get("group_size", 128)), triton):  # the 4-bit modules, whatever the default
        done.append("int4 triton" if triton else "int4 tinygemm")
    if use_int8_kernels(model, triton):
        done.append("int8 triton" if triton else "int8 torch")
    if any(isinstance(m, GPTQLinear) and m.bits in PLANE_BITS for m in model.modules()):
        done.append("3/5/6-bit triton" if triton and use_plane_kernels(model) else "3/5/6-bit dequantized per call")
    return done


def _bnb_swap(art, model) -> None:
    swap_bnb_linears(art, model)


def _bnb_rename(name: str) -> str | None:
    return rename_bnb_key(name)


def _bnb_finish(art, model, dtype: torch.dtype, kernels: str) -> list[str]:
    """bf16 compute: LLM.int8 layers on the int8 kernels; NF4 dequantizes per call."""
    triton = kernels == "triton"
    return (["int8 triton" if triton else "int8 torch"] if dtype == torch.bfloat16 and use_int8_kernels(model, triton)
            else [])


def _fp8_swap(art, model) -> None:
    """compressed-tensors' float-quantized folders of FP8 weights with a scale per output channel
    (llm-compressor's FP8_DYNAMIC, quantize --method fp8; static activation scales are read as
    dynamic per-token ones)."""
    q = art.quantization
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if (w.get("type"), w.get("num_bits"), w.get("strategy")) != ("float", 8, "channel"):
            raise CheckpointError(f"{art.path}: compressed-tensors group {name} quantizes weights as "
                                  f"{w.get('type')} {w.get('num_bits')}-bit per {w.get('strategy')}, which the runtime "
                                  "does not read", "llamactl reads FP8 weights with a scale per channel "
                                  "(llamactl quantize --method fp8 writes them)")
    names = sorted(n[: -len(".weight_scale")] for n in art.tensor_index() if n.endswith(".weight_scale"))
    if not names:
        raise CheckpointError(f"{art.path}: config.json says compressed-tensors but no tensor ends in .weight_scale")
    with torch.device("meta"):
        swap_linears(model, names, lambda lin: FP8Linear(lin.in_features, lin.out_features, lin.bias is not None))


def _fp8_rename(name: str) -> str | None:
    return None if name.endswith(".input_scale") else name  # static activation scales: per token here


def _fp8_finish(art, model, dtype: torch.dtype, kernels: str) -> list[str]:
    label = use_fp8_kernels(model)
    return [label] if label else []


GPTQ = Format("gptq", _gptq_swap, lambda n: n, _gptq_finish)
BITSANDBYTES = Format("bitsandbytes", _bnb_swap, _bnb_rename, _bnb_finish)
COMPRESSED_TENSORS = Format("compressed-tensors", _fp8_swap, _fp8_rename, _fp8_finish)
FORMATS = {f.quant_method: f for f in (GPTQ, BITSANDBYTES, COMPRESSED_TENSORS)}


def for_checkpoint(art) -> Format:
    """The format of a quantized folder (config.json's quant_method); raises CheckpointError."""
    method = art.quantization.get("quant_method")
    if method not in FORMATS:
        raise CheckpointError(f"{art.path}: quantization method {method!r} is not supported by this runtime",
                              f"llamactl reads {', '.join(FORMATS)} checkpoints")
    return FORMATS[method]
