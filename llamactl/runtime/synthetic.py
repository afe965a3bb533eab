"""Named model shapes with random weights, built directly on the device (no checkpoint needed)."""

from __future__ import annotations

from typing import Callable

import torch

from llamactl.errors import InputError
from llamactl.folder.config import LlamaArgs
from llamactl.layers import rtn
from llamactl.layers.cpu import bf16_fast, quant_fast
from llamactl.layers.int8 import available
from llamactl.runtime.model import LlamaModel, RMSNorm
from llamactl.runtime.tp import local_args, plan_synthetic

SHAPES: dict[str, dict] = {
    "tiny": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096),
    # the shape of the 135M GQA models of the CPU issue (hidden 576: no multiple of 128)
    "llama-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048),
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    # llama2-7b's shape at 32K positions (Together's LLaMA-2-7B-32K): the long-context MHA model
    # whose KV cache outweighs its int4 weights (8 GiB of bf16 K/V at 16K tokens)
    "llama2-7b-32k": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768),
    "llama2-13b": dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                       num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                       rope_theta=500000.0),
}


def synthetic_args(name: str) -> LlamaArgs:
    if name not in SHAPES:
        raise InputError(f"--synthetic {name!r} is not a known shape", f"use one of {', '.join(SHAPES)}")
    s = dict(SHAPES[name])
    return LlamaArgs(head_dim=s["hidden_size"] // s["num_attention_heads"], rms_norm_eps=1e-5,
                     rope_scaling={"rope_type": "default"}, **s)


def hf_config(args: LlamaArgs) -> dict:
    """A config.json dict for the same shape (for transformers' reference model)."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": args.vocab_size,
            "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
            "num_hidden_layers": args.num_hidden_layers, "num_attention_heads": args.num_attention_heads,
            "num_key_value_heads": args.num_key_value_heads, "head_dim": args.head_dim,
            "max_position_embeddings": args.max_position_embeddings, "rms_norm_eps": args.rms_norm_eps,
            "rope_theta": args.rope_theta, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


@torch.no_grad()
def build_synthetic(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0, shard=None,
                    quantize: Callable[[torch.nn.Module], object] | None = None, weight_bits: float = 16):
    """A LlamaModel of shape `name` with N(0, 0.02) weights, allocated on `device` directly;
    shard: one tensor-parallel rank's part of it (tp.Shard), the rank's seed its own.
    quantize: applied to each decoder layer as soon as its weights are drawn (before the next one
    is allocated), so a model whose 16-bit weights would not fit the device fits in its quantized
    size plus one 16-bit layer (llama3-70b in int4 on one H200); weight_bits: what a decoder
    weight takes after it, with its scales, for the memory check. The weights are the same draws
    either way (one generator, the parameters in the model's order)."""
    args = synthetic_args(name)
    if shard is not None:
        args, seed = local_args(args, shard), seed + shard.rank
    _check_memory(name, args, device, dtype, weight_bits if quantize else 16)
    with torch.device("meta"):
        model = LlamaModel(args)
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(part: torch.nn.Module) -> None:  # allocated, then its weights drawn in order (norms: ones)
        part.to_empty(device=device).to(dtype)
        norms = {id(m.weight) for m in part.modules() if isinstance(m, RMSNorm)}
        for p in part.parameters():
            if id(p) in norms:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)

    inner = model.model
    draw(inner.embed_tokens)
    for layer in inner.layers:
        draw(layer)
        if quantize is not None:
            quantize(layer)
    draw(inner.norm)
    draw(model.lm_head)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise RuntimeError("build_synthetic left tensors unallocated: a module outside embeddings, layers, norm and head")
    return model.eval()


def peak_weight_bytes(args: LlamaArgs, dtype: torch.dtype, weight_bits: float = 16) -> int:
    """The most bytes of weights build_synthetic holds: the decoder's at weight_bits each (with one
    layer in dtype while it is drawn, where they are quantized), the embeddings and head in dtype."""
    a = args
    layer = a.hidden_size * a.head_dim * 2 * (a.num_attention_heads + a.num_key_value_heads) + 3 * a.hidden_size * a.intermediate_size
    bits = torch.finfo(dtype).bits
    drawn = layer * bits if weight_bits < bits else 0
    return int(a.num_hidden_layers * layer * min(weight_bits, bits) + drawn + 2 * a.vocab_size * a.hidden_size * bits) // 8


def _check_memory(name: str, args: LlamaArgs, device: torch.device, dtype: torch.dtype,
                  weight_bits: float = 16) -> None:
    """InputError, before allocating, when the weights would not fit the device's free memory."""
    need = peak_weight_bytes(args, dtype, weight_bits)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import os

        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return
    if need > 0.9 * free:
        raise InputError(f"--synthetic {name} needs {need / 2**30:.1f} GiB of weights in {str(dtype).replace('torch.', '')}; "
                         f"{device} has {free / 2**30:.1f} GiB free", "pick a smaller shape or another device")


def _synthetic_quantizer(quant: str, device: torch.device, kernels: str, tp: bool):
    """(what quantizes one decoder layer as synthetic.build_synthetic draws it, or None; the bits a
    weight then takes with its scales, about; the label's words) for --synthetic-quant `quant`:
    RTN, group 128 (int8: per channel); kernels: layers.plan.linear_kernels."""
    triton = kernels == "triton"
    if quant == "none":
        return None, 16, ""
    if quant == "fp8":
        if tp:
            raise InputError("--synthetic-quant fp8 with --tp is not supported", "use int4 or int8 with --tp")
        return lambda layer: rtn.quantize_linears_fp8(layer, every=True), 8.1, "fp8"
    bits = int(quant[3:])
    if kernels == "cpu":  # every width on llamactl's CPU layers (RTN, as below)
        if quant_fast():
            group = -1 if bits == 8 else 128
            return (lambda layer: rtn.quantize_linears_planes(layer, bits, group, False, cpu=True, every=True),
                    bits + 0.2, quant + ("" if bits == 8 else "-g128"))
    if quant == "int4":
        return lambda layer: rtn.quantize_linears_int4(layer, triton, 128, every=True), 4.2, "int4-g128"
    if quant == "int8":
        if not available(device.type, triton):
            raise InputError(f"--synthetic-quant int8 has no int8 kernel on {device.type}", "run it on CUDA, or on a CPU torch with _weight_int8pack_mm")
        return lambda layer: rtn.quantize_linears_int8(layer, triton, every=True), 8.1, "int8"
    if tp:
        raise InputError(f"--synthetic-quant {quant} with --tp is not supported", "use int4 or int8 with --tp")
    return (lambda layer: rtn.quantize_linears_planes(layer, bits, 128, triton, every=True), bits + 0.2,
            f"{quant}-g128" + ("" if triton else " (dequantized per call)"))


def synthetic_model(shape: str, quant: str, device: torch.device, dtype: torch.dtype, kernels: str,
                    world=None) -> tuple[str, "torch.nn.Module"]:
    """(label, model) of random weights of a named shape, its decoder linears RTN-quantized to
    `quant` (none, int3-int8, fp8) as each layer is drawn; kernels: layers.plan.linear_kernels
    ("triton", "cpu" or "torch"); world: a tensor-parallel group (this rank's shard)."""
    if quant not in ("none", "int3", "int4", "int5", "int6", "int8", "fp8"):
        raise InputError(f"--synthetic-quant {quant!r} is not supported",
                         "use int3, int4, int5, int6, int8, fp8 or none (a comma list for several)")
    if quant != "none" and dtype != torch.bfloat16:
        raise InputError(f"--synthetic-quant {quant} runs the low-bit kernels with bf16 activations", "pass --dtype bfloat16")
    shard = None
    if world is not None:
        shard = plan_synthetic(synthetic_args(shape), quant, world.rank, world.size)
    label = f"synthetic:{shape}"
    quantize, bits, label_quant = _synthetic_quantizer(quant, device, kernels, world is not None)
    model = build_synthetic(shape, device, dtype, shard=shard, quantize=quantize, weight_bits=bits)
    if world is not None:
        for layer in model.model.layers:
            layer.self_attn.tp_group = layer.mlp.tp_group = world.group
        model.tp = shard
    return label + (f" {label_quant}" if label_quant else ""), model


def synthetic_dtype(dtype_name: str, device: torch.device, kernels: str) -> torch.dtype:
    """--dtype for random weights: auto is bf16 on CUDA and on CPUs with llamactl's fast bf16
    kernels, else float32."""
    if dtype_name != "auto":
        return getattr(torch, dtype_name)
    return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and kernels == "cpu" and bf16_fast()) \
        else torch.float32
