"""Linear layers that run batch-1 rows through llamactl's Triton GEMV kernels, and the switch that
puts them (and the split-KV decode attention) into a model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llamactl import kernels
from llamactl.env import QUANT_INPUT_LABELS, QUANT_INPUTS, choice
from llamactl.kernels import pinned
from llamactl.model import swiglu


class FusedIO:
    """Mixin for projections whose batch-1 kernel can fold in the RMSNorm before them (`norm`), the
    SwiGLU of a fused gate/up input (`glu`, on down_proj) and the residual add after them: one kernel
    instead of three or four. set_kernels arranges it; longer inputs apply the same steps unfused."""

    fuses_residual = True

    def _init_fused_io(self) -> None:
        self.norm: nn.Module | None = None  # an instance attribute: a class one would hide the submodule
        self.glu = False  # down_proj: the input is a fused [gate; up] output, SwiGLU applied on reading it
        self.glu_out = False  # gate_up_proj: return silu(gate) * up of its own output instead

    def can_fuse(self) -> bool:
        return getattr(self, "bias", None) is None

    def _norm_args(self) -> tuple[torch.Tensor | None, float]:
        return (None, 1e-6) if self.norm is None else (self.norm.weight, self.norm.eps)

    def _unfused_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return swiglu(x) if self.glu else x

    def _unfused_output(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu(y) if self.glu_out else y

    def _input_width(self) -> int:
        return self.in_features * (2 if self.glu else 1)

    def _output_width(self) -> int:
        return self.out_features // (2 if self.glu_out else 1)


class GemvLinear(nn.Linear, FusedIO):
    """nn.Linear whose single-row inputs go through the Triton GEMV (with FusedIO's folded steps);
    more rows go to cuBLAS."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused_io()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] ([..., 2 in] with glu), residual: [..., out] or None -> [..., out]
        if x.numel() == self._input_width() and self.bias is None:
            from llamactl.kernels.gemv import gemv

            y = gemv(x.reshape(-1), self.weight, None, *self._norm_args(),
                     None if residual is None else residual.reshape(-1), self.glu, self.glu_out)
            return y.view(*x.shape[:-1], self._output_width())
        y = self._unfused_output(F.linear(self._unfused_input(x), self.weight, self.bias))
        return y if residual is None else residual + y


class TritonInt4Linear(nn.Module, FusedIO):
    """y = x W^T with W in 4 bits (groups along the input), in the layout of kernels.gemv.

    Single rows run the int4 GEMV (reads 4 bits a weight); longer inputs (prefill) dequantize the
    layer to 16 bits with a Triton kernel and use cuBLAS.
    """

    def __init__(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, perm: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None, device: torch.device):
        """codes: [out, in] in group order, zeros/scales: [groups, out], perm: [in] or None."""
        super().__init__()
        from llamactl.kernels.gemv import pack_int4

        self._set(pack_int4(codes.to(device)), scales.t().to(device=device, dtype=torch.float16),
                  zeros.t().to(device=device, dtype=torch.uint8), None if perm is None else perm.to(device), group_size,
                  None if bias is None else bias.to(device=device, dtype=torch.bfloat16))

    def _set(self, qweight, scales, zeros, perm, group_size: int, bias) -> None:
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 8
        self.group_size = group_size
        self.register_buffer("qweight", qweight.contiguous())  # [out, in // 8] int32
        self.register_buffer("scales", scales.contiguous())  # [out, groups] fp16
        self.register_buffer("zeros", zeros.contiguous())  # [out, groups] uint8
        self.register_buffer("perm", perm)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.inputs = "float"  # what the batch-1 GEMV multiplies the weights with (see quant_inputs)
        self._init_fused_io()

    def can_fuse(self) -> bool:
        return self.bias is None and self.perm is None  # act-order layers gather x first: not fused

    @classmethod
    def concat(cls, mods: list["TritonInt4Linear"]) -> "TritonInt4Linear | None":
        """One layer computing the outputs of `mods` (same input) side by side, or None when their
        input orders (act-order permutations) or group sizes differ."""
        first = mods[0]
        if any(m.group_size != first.group_size or m.perm is not None or (m.bias is None) != (first.bias is None)
               for m in mods):
            return None
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        bias = None if first.bias is None else torch.cat([m.bias for m in mods])
        fused._set(torch.cat([m.qweight for m in mods]), torch.cat([m.scales for m in mods]),
                   torch.cat([m.zeros for m in mods]), None, first.group_size, bias)
        return fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] ([..., 2 in] with glu), residual: [..., out] or None -> [..., out]
        from llamactl.kernels.gemv import dequantize_int4, gemv_int4

        if x.numel() == self._input_width() and self.can_fuse():
            y = gemv_int4(x.reshape(-1), self.qweight, self.scales, self.zeros, self.group_size, *self._norm_args(),
                          None if residual is None else residual.reshape(-1), self.glu, self.glu_out, self.inputs)
            return y.view(*x.shape[:-1], self._output_width())
        x2 = self._unfused_input(x).reshape(-1, self.in_features)  # [M, in]
        if self.perm is not None:
            x2 = x2[:, self.perm]
        if x2.shape[0] <= 8:  # decode: one GEMV per row still reads far fewer bytes than dequantizing
            y = torch.stack([gemv_int4(row.contiguous(), self.qweight, self.scales, self.zeros, self.group_size,
                                       inputs=self.inputs) for row in x2])
        else:
            y = F.linear(x2, dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        y = self._unfused_output(y.view(*x.shape[:-1], self.out_features))
        return y if residual is None else residual + y


def _swap_linear(mod: nn.Linear, cls: type) -> nn.Linear:
    new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
    new.weight = mod.weight
    if mod.bias is not None:
        new.bias = mod.bias
    return new


def _norm_sites(model) -> list[tuple[nn.Module, str, nn.Module | None]]:
    """(owner, attribute of the RMSNorm, the one projection that reads its output)."""
    sites = [(l, "input_layernorm", l.self_attn.qkv_proj) for l in model.model.layers]
    sites += [(l, "post_attention_layernorm", l.mlp.gate_up_proj) for l in model.model.layers]
    return sites + [(model.model, "norm", model.lm_head)]


def _unfuse(model) -> None:
    """Put every RMSNorm folded into a projection back in its place, and clear glu/glu_out."""
    for owner, attr, lin in _norm_sites(model):
        if isinstance(lin, FusedIO) and lin.norm is not None:
            setattr(owner, attr, lin.norm)
            lin.norm = None
    for layer in model.model.layers:
        for lin in (layer.mlp.down_proj, layer.mlp.gate_up_proj):
            if isinstance(lin, FusedIO):
                lin.glu = lin.glu_out = False


def swiglu_site() -> str:
    """Where the decode step applies SwiGLU: "gate_up" (gate_up_proj's kernel, once per element, on
    its output; the default) or "down" (down_proj's kernel, on reading its input: every program
    recomputes the SiLU over the whole input). LLAMACTL_SWIGLU chooses. On the H200 "gate_up" made
    the llama2-7b MLP 47.3 -> 42.4 us in int4, 51.6 -> 49.3 in int8, 72.5 -> 71.5 in bf16
    (docs/bench/run14-probe.txt) and int4 decode 384 -> 409 tok/s (run15)."""
    return choice("LLAMACTL_SWIGLU", "gate_up", ("gate_up", "down"))


def quant_inputs() -> str:
    """What the int4 and int8 GEMVs multiply their weights with: "int16" (the default, see below),
    "float" (x as it is, in float32), "int8" (x rounded to int8 per 32 columns after the folded RMSNorm/SwiGLU and
    multiplied in integers with DP4A: sm_90 instructions a weight 4.1-6.6 -> 1.5-3.2 for int4,
    4.7-7.2 -> 1.5-7.9 for int8 (the wide blocks 1.5-2.2), docs/bench/README.md; on docs-llama-17m
    it added 0.0004 nats to the int4 models' KL, docs/bench/quant-inputs-kl.txt) or "fp16" (x
    scaled by a power of two per 32 columns, exact for bf16 inputs, and multiplied in packed fp16,
    two weights an instruction: 4.4-5.0 -> 2.5-3.6 sm_90 instructions a weight for int4, 3.9-4.3
    -> 2.5-3.3 for int8; relative error ~5e-4, below bf16's output rounding; kernels.half_math) or
    "int16" (x scaled by a power of two per 32 columns and rounded to int16, exact within 2^7 of
    the block's largest, else to 2^-15 of it; products summed in integers by DP2A, exactly: 2.2-2.8
    sm_90 instructions a weight for int4, 1.5-2.1 for int8; kernels.int16_inputs). int16 is the
    default: the most exact after float (relative error ~3e-5 against float64 for float32 x,
    bf16 x within 2^7 of its block's largest exact; on docs-llama-17m int4 its decode KL was
    0.08569 nats against 0.08553 for prefill's float path and 0.08584 for fp16, run 41) and the
    fastest after int8 (llama2-7b int4 on the H200: 616.9 tok/s, 2.19x bf16, against 451 in float32).
    LLAMACTL_QUANT_INPUTS chooses; prefill (cuBLAS) is not affected."""
    return choice("LLAMACTL_QUANT_INPUTS", "int16", QUANT_INPUTS)


def quant_input_layers(model) -> list[nn.Module]:
    """The layers whose batch-1 GEMV takes the quant_inputs choice (int16, int8, fp16): the int4
    ones, and the int8 ones with whole 32-column blocks."""
    from llamactl.quantize.int8 import Int8Kernel

    return [m for m in model.modules()
            if isinstance(m, TritonInt4Linear) or (isinstance(m, Int8Kernel) and m.in_features % 32 == 0)]


def _fuse(model, swiglu_at: str) -> None:
    """Fold each RMSNorm into the one projection that reads it, and SwiGLU into down_proj or
    gate_up_proj (swiglu_at, see swiglu_site)."""
    for owner, attr, lin in _norm_sites(model):
        if isinstance(lin, FusedIO) and lin.can_fuse():
            lin.norm = getattr(owner, attr)
            setattr(owner, attr, nn.Identity())
    for layer in model.model.layers:
        gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
        if swiglu_at == "gate_up" and isinstance(gate_up, FusedIO) and gate_up.can_fuse():
            gate_up.glu_out = True
        elif gate_up is not None and isinstance(down, FusedIO) and down.can_fuse():
            down.glu = True


@torch.no_grad()
def set_kernels(model, on: bool) -> dict[str, str]:
    """Route the model's float linears and decode attention through llamactl's Triton kernels
    (on) or through cuBLAS and SDPA (off). Returns what runs, for reports."""
    on = on and kernels.available(model.device)
    _unfuse(model)
    for name, mod in list(model.named_modules()):
        if type(mod) in (nn.Linear, GemvLinear) and mod.weight.is_floating_point():
            cls = GemvLinear if on else nn.Linear
            if type(mod) is not cls:
                parent, _, child = name.rpartition(".")
                owner = model.get_submodule(parent) if parent else model
                setattr(owner, child, _swap_linear(mod, cls))
    layers = quant_input_layers(model)
    # the chosen inputs' own check (int16 by default) runs only for a model that has such layers (a failure warns)
    inputs = quant_inputs() if on and layers else "float"
    inputs = inputs if inputs == "float" or kernels.inputs_available(model.device, inputs) else "float"
    for mod in layers:
        mod.inputs = inputs
    if on:
        site = swiglu_site()
        _fuse(model, site)
    hd = model.args.head_dim
    attn = "rope" if on and hd >= 16 and hd & (hd - 1) == 0 else ""
    for layer in model.model.layers:
        layer.self_attn.decode_kernel = attn
    if not on:
        return {"gemv": "cublas" if model.device.type == "cuda" else "torch", "decode_attention": "sdpa"}
    gemv = (f"triton {kernels.triton_version()}" + (", SwiGLU before down" if site == "down" else "")
            + (", PDL" if kernels.pdl(model.device) else "") + (f", {QUANT_INPUT_LABELS[inputs]}" if inputs != "float" else "")
            + pinned.label(model.device))
    from llamactl.kernels.attention import label as attention_label  # Triton: only with the kernels on

    return {"gemv": gemv, "decode_attention": attention_label() if attn else "sdpa"}


def unfold_cache_writes(model) -> None:
    """Use the attention kernel without the folded RoPE/cache write: torch.compile's regional
    compilation cannot functionalize a custom op that mutates its inputs (the KV cache)."""
    for layer in model.model.layers:
        if layer.self_attn.decode_kernel == "rope":
            layer.self_attn.decode_kernel = "plain"
