"""prepare(model, options): put the decode step's kernels into a model once and say what runs.

The Plan has a field for each choice that ran (kernels, PDL, the int4/int8 GEMVs' inputs, the
SwiGLU site, the decode attention, the pinned configs); code compares the fields, `label` is for
people. Preparing changes the model's modules (fused projections, folded norms), never its
outputs beyond the kernels' rounding, and no process-wide setting.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from llamactl.kernels import check, mma as kmma, pinned, cpu as kcpu
from llamactl.kernels.arith import QUANT_INPUT_LABELS
from llamactl.kernels.device import pdl_supported, runs_on, triton_version
from llamactl.layers.cpu import CpuLinear, bf16_fast, quant_fast, kernels_load
from llamactl.layers.fp8 import FP8Linear
from llamactl.layers.fused import FusedIO, GemvLinear, fuse, swap_linear, unfuse
from llamactl.layers.gptq import GPTQLinear
from llamactl.layers.int4 import Int4Linear, TritonInt4Linear
from llamactl.layers.int8 import Int8Kernel
from llamactl.layers.mma import MmaCodes
from llamactl.options import RuntimeOptions
from llamactl.runtime.model import RMSNorm


@dataclass(frozen=True)
class Plan:
    """What the decode step runs. gemv: "triton", "cublas", "llamactl cpu" (kernels.cpu) or "torch"; inputs: what the int4/int8
    GEMVs multiply with ("float" where there are none); swiglu: the kernel that applies SwiGLU
    (None: unfused); attention: "triton split-kv", "llamactl cpu" or "sdpa"; pins: where the pinned configs came
    from (None: autotuned); warnings: kernels that failed their self-check and were left out."""

    gemv: str
    triton: str | None = None
    pdl: bool = False
    inputs: str = "float"
    swiglu: str | None = None
    attention: str = "sdpa"
    attn_min_chunk: int | None = None
    pins: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def kernels(self) -> bool:
        return self.gemv == "triton"

    @property
    def label(self) -> str:
        """The GEMV for people: "triton 3.6.0, PDL, int16 inputs, pinned configs", or "cublas"."""
        if not self.kernels:
            return self.gemv
        return (f"triton {self.triton}" + (", SwiGLU before down" if self.swiglu == "down" else "")
                + (", PDL" if self.pdl else "") + (f", {QUANT_INPUT_LABELS[self.inputs]}" if self.inputs != "float" else "")
                + (", pinned configs" if self.pins else ""))

    @property
    def attention_label(self) -> str:
        if self.attention in ("sdpa", "llamactl cpu"):
            return self.attention
        from llamactl.kernels.attention import label

        return label(self.attn_min_chunk)

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def kernels_run(device: torch.device, options: RuntimeOptions, interpreter: bool = False) -> tuple[bool, str | None]:
    """Whether llamactl's kernels run the model on `device` (CUDA with Triton, the self-check
    passed; the CPU only through Triton's interpreter when `interpreter`), and the warning when
    they were wanted and failed their check. The loader and prepare both ask this."""
    if not options.kernels or not runs_on(device) or (device.type == "cpu" and not interpreter):
        return False, None
    problem = check.passed(device)
    if problem:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        return False, (f"llamactl's Triton kernels failed their check on {name} ({problem}); "
                       "using cuBLAS/SDPA/tinygemm instead (--kernels off silences this)")
    return True, None


def linear_kernels(device: torch.device, options: RuntimeOptions, interpreter: bool = False) -> str:
    """Which kernels the linears run on: "triton" (kernels_run), "cpu" (llamactl's CPU kernels,
    built and loaded; options.kernels) or "torch"."""
    if kernels_run(device, options, interpreter)[0]:
        return "triton"
    if device.type == "cpu" and options.kernels:
        if quant_fast() or bf16_fast():
            return "cpu"
    return "torch"


def quant_input_layers(model) -> list[nn.Module]:
    """The layers whose batch-1 GEMV takes RuntimeOptions.quant_inputs: the int4 ones, and the
    int8 ones with whole 32-column blocks."""
    return [m for m in model.modules()
            if isinstance(m, TritonInt4Linear) or (isinstance(m, Int8Kernel) and m.in_features % 32 == 0)]


def fp8_plan(model, on: bool, pdl: bool) -> list[str]:
    """FP8 layers (layers.fp8): one row on llamactl's GEMV where its kernels run (`on`); the
    warning where there are no FP8 tensor cores (on the CPU the weights are dequantized once)."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for m in layers:
        m.gemv, m.pdl = on, pdl
        if model.device.type == "cpu":
            m.keep_dense(model.dtype)
    if not layers or layers[0].scaled_mm:
        return []
    if model.device.type == "cpu":
        return [f"FP8 weights on the CPU: dequantized to {str(model.dtype).replace('torch.', '')} once (no FP8 "
                "products here), so they take 16-bit memory and speed; activations are rounded per token as on a GPU"]
    return [f"no FP8 tensor cores on {torch.cuda.get_device_name(model.device)}: FP8 products of 2+ rows dequantize "
            "their weights each call (one row reads them as they are)"]


def mma_plan(model, want: bool) -> list[str]:
    """int4, int8 and FP8 layers' 2-64 row products on the tensor-core kernel where `want` and it runs
    (bf16 and fp16 models, shapes it takes; laid out for it here, before any graph is captured);
    the warning where it was asked for and cannot run."""
    layers = [m for m in model.modules() if isinstance(m, MmaCodes)]
    why = kmma.available() if want and layers else None
    if want and layers and why is None and model.dtype not in kmma.DTYPES:
        why = f"the low-bit MMA kernel multiplies bf16 or fp16 activations, not {str(model.dtype).replace('torch.', '')}"
    for m in layers:
        m.use_mma(want and why is None, model.dtype)
    return [f"{why}; low-bit decode batches keep their other kernels"] if why else []


@torch.no_grad()
def prepare(model, options: RuntimeOptions | None = None, interpreter: bool = False) -> Plan:
    """Route the model's linears and decode attention through llamactl's kernels where they run
    (options.kernels), else through cuBLAS/SDPA, with the options' launch settings; returns the
    Plan of what runs. May be called again with other options. interpreter: on the CPU, run the
    kernels through Triton's interpreter (tests)."""
    options = options or RuntimeOptions()
    device = model.device
    model.fuse_projections()
    on, warning = kernels_run(device, options, interpreter)
    warnings = [warning] if warning else []
    cpu = not on and linear_kernels(device, options) == "cpu"
    bf16 = False  # the 16-bit layers on llamactl's CPU product (with AVX-512 BF16 only)
    if device.type == "cpu" and options.kernels and not on:
        if kernels_load() is not None:
            warnings.append(f"{kernels_load()}; the CPU runs torch's kernels (--kernels off silences this)")
        bf16 = cpu and bf16_fast()
    unfuse(model)
    for name, mod in list(model.named_modules()):
        if type(mod) in (nn.Linear, GemvLinear, CpuLinear) and mod.weight.is_floating_point():
            cls = GemvLinear if on else CpuLinear if bf16 and mod.weight.dtype == torch.bfloat16 else nn.Linear
            if type(mod) is not cls:
                parent, _, child = name.rpartition(".")
                owner = model.get_submodule(parent) if parent else model
                setattr(owner, child, swap_linear(mod, cls))
    layers = quant_input_layers(model)
    inputs = options.quant_inputs if on and layers else "float"
    if inputs != "float":
        problem = check.passed(device, inputs)
        if problem:
            warnings.append(f"llamactl's {inputs}-input GEMVs failed their check on {device} ({problem}); using float inputs")
            inputs = "float"
    for mod in layers:
        mod.inputs = inputs
    pdl = on and options.pdl and pdl_supported(device)
    pins = pinned.resolve(device, options.pins, options.pins_file) if on else pinned.NONE
    skinny = on and model.dtype in (torch.float16, torch.bfloat16)  # float32 would multiply in TF32
    for mod in model.modules():
        if isinstance(mod, FusedIO):
            mod.pdl, mod.pins, mod.glue_kernels, mod.skinny = pdl, pins.id, on, skinny
        elif isinstance(mod, RMSNorm):
            mod.kernel, mod.pdl = on, pdl
    warnings += fp8_plan(model, on, pdl)
    if on:
        fuse(model, options.swiglu)
    warnings += mma_plan(model, on and options.mma)
    hd, group = model.args.head_dim, model.args.num_attention_heads // model.args.num_key_value_heads
    attn = "rope" if on and hd >= 16 and hd & (hd - 1) == 0 else "cpu" if cpu and cpu_attention_fits(hd, group) else ""
    for layer in model.model.layers:
        at = layer.self_attn
        at.decode_kernel, at.attn_min_chunk, at.pdl = attn, options.attn_min_chunk, pdl
        at.rope_kernel = on
    if not on:
        return Plan(gemv="cublas" if device.type == "cuda" else "llamactl cpu" if cpu else "torch",
                    attention="llamactl cpu" if attn == "cpu" else "sdpa", warnings=tuple(warnings))
    return Plan(gemv="triton", triton=triton_version(), pdl=pdl, inputs=inputs,
                swiglu=_swiglu_site(model), attention="triton split-kv" if attn else "sdpa",
                attn_min_chunk=options.attn_min_chunk if attn else None, pins=pins.source, warnings=tuple(warnings))


def cpu_attention_fits(head_dim: int, group: int) -> bool:
    """Whether llamactl's CPU decode attention takes heads of head_dim with `group` query heads a
    KV head (else SDPA)."""
    return head_dim <= kcpu.ATTN_MAX_HEAD_DIM and group <= kcpu.ATTN_MAX_GROUP


def products(model, rows: int) -> str:
    """What the decode step's linears run at `rows` rows, each kind once ("int4 split-K; 16-bit
    cuBLAS"): the layers that say (product()), torch's for the rest."""
    seen: dict[str, None] = {}
    for mod in model.modules():
        if hasattr(mod, "product"):
            seen[mod.product(rows)] = None
        elif type(mod) is nn.Linear or isinstance(mod, (GPTQLinear, Int4Linear)):
            seen[f"torch {type(mod).__name__}"] = None
    return "; ".join(seen)


def _swiglu_site(model) -> str | None:
    """Which kernel applies SwiGLU after fuse: "gate_up" (its output), "down" (its input) or None."""
    mlp = model.model.layers[0].mlp if len(model.model.layers) else None
    if mlp is None:
        return None
    if getattr(mlp.gate_up_proj, "glu_out", False):
        return "gate_up"
    return "down" if getattr(mlp.down_proj, "glu", False) else None


def unfold_cache_writes(model) -> None:
    """Use the attention kernel without the folded RoPE/cache write: torch.compile's regional
    compilation cannot functionalize a custom op that mutates its inputs (the KV cache)."""
    for layer in model.model.layers:
        if layer.self_attn.decode_kernel == "rope":
            layer.self_attn.decode_kernel = "plain"
