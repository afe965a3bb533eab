"""The 16-bit GEMV linear and the folding of RMSNorm, SwiGLU and the residual add into the
projections around them (the int4/int8 layers share FusedIO)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llamactl.runtime.model import swiglu


class FusedIO:
    """Mixin for projections whose batch-1 kernel can fold in the RMSNorm before them (`norm`), the
    SwiGLU of a fused gate/up input (`glu`, on down_proj) and the residual add after them: one kernel
    instead of three or four. layers.prepare arranges it; longer inputs apply the same steps unfused.
`pdl` and `pins` are the launch settings of the plan (programmatic dependent launch, the id of
a kernels.pinned table)."""

    fuses_residual = True
    glu_out_ok = True  # SwiGLU may be folded into this layer's output (gate_up_proj), else into down_proj's input

    def _init_fused_io(self) -> None:
        self.norm: nn.Module | None = None  # an instance attribute: a class one would hide the submodule
        self.glu = False  # down_proj: the input is a fused [gate; up] output, SwiGLU applied on reading it
        self.glu_out = False  # gate_up_proj: return silu(gate) * up of its own output instead
        self.pdl = False
        self.pins = ""
        self.glue_kernels = False  # more rows: SwiGLU as one Triton kernel (the norm module has its own switch)
        self.skinny = False  # 2 to skinny.LAYER_ROWS rows: kernels.skinny, SwiGLU and the residual folded in

    def can_fuse(self) -> bool:
        return getattr(self, "bias", None) is None

    def _norm_args(self) -> tuple[torch.Tensor | None, float]:
        return (None, 1e-6) if self.norm is None else (self.norm.weight, self.norm.eps)

    def _unfused_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm is not None:
            x = self.norm(x)
        return swiglu(x, self.glue_kernels, self.pdl) if self.glu else x

    def _unfused_output(self, y: torch.Tensor) -> torch.Tensor:
        return swiglu(y, self.glue_kernels, self.pdl) if self.glu_out else y

    def _skinny_takes(self, rows: int) -> bool:
        """Whether kernels.skinny multiplies `rows` rows (2 or more) of this layer."""
        from llamactl.kernels.skinny import LAYER_ROWS

        return self.skinny and self.can_fuse() and rows <= LAYER_ROWS

    def _skinny_rows(self, x: torch.Tensor) -> int:
        """How many rows x holds if kernels.skinny is to multiply them, else 0."""
        rows = x.numel() // self._input_width()
        half = x.dtype in (torch.float16, torch.bfloat16)  # float32 would multiply in TF32
        return rows if half and rows > 1 and self._skinny_takes(rows) else 0

    def _skinny_io(self, x: torch.Tensor, rows: int, residual: torch.Tensor | None):
        """The skinny product's input (the norm applied, SwiGLU left to the product: glu) and the
        residual it adds (none where SwiGLU follows: glu_out)."""
        if self.norm is not None:
            x = self.norm(x)
        fold = residual is not None and not self.glu_out
        return x.reshape(rows, self._input_width()), residual.reshape(rows, -1) if fold else None

    def _skinny_out(self, y: torch.Tensor, shape, residual: torch.Tensor | None) -> torch.Tensor:
        # y: [rows, out] -> [..., out] with glu_out's SwiGLU and a residual not yet added
        if self.glu_out:
            y = self._unfused_output(y)
            y = y if residual is None else residual.reshape(y.shape) + y
        return y.view(*shape[:-1], self._output_width())

    def _input_width(self) -> int:
        return self.in_features * (2 if self.glu else 1)

    def _output_width(self) -> int:
        return self.out_features // (2 if self.glu_out else 1)


class GemvLinear(nn.Linear, FusedIO):
    """nn.Linear whose single-row inputs go through the Triton GEMV (with FusedIO's folded steps);
    2 to skinny.LAYER_ROWS rows of 16-bit x through kernels.skinny (SwiGLU and the residual
    folded); more rows to cuBLAS."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_fused_io()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] ([..., 2 in] with glu), residual: [..., out] or None -> [..., out]
        if x.numel() == self._input_width() and self.bias is None:
            from llamactl.kernels.gemv import gemv

            y = gemv(x.reshape(-1), self.weight, None, *self._norm_args(),
                     None if residual is None else residual.reshape(-1), self.glu, self.glu_out, "float",
                     self.pdl, self.pins)
            return y.view(*x.shape[:-1], self._output_width())
        rows = self._skinny_rows(x)
        if rows:  # a decode batch: the weights read once for all rows, SwiGLU and the residual folded in
            from llamactl.kernels.skinny import skinny_mm

            x2, r2 = self._skinny_io(x, rows, residual)
            return self._skinny_out(skinny_mm(x2, self.weight, r2, self.glu, pdl=self.pdl), x.shape, residual)
        y = self._unfused_output(F.linear(self._unfused_input(x), self.weight, self.bias))
        return y if residual is None else residual + y

    def product(self, rows: int) -> str:
        """What multiplies `rows` rows (bench rows name it)."""
        if rows == 1:
            return "16-bit GEMV"
        return "16-bit skinny" if self._skinny_takes(rows) else "16-bit cuBLAS"


def swap_linear(mod: nn.Linear, cls: type) -> nn.Linear:
    new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
    new.weight = mod.weight
    if mod.bias is not None:
        new.bias = mod.bias
    return new


def norm_sites(model) -> list[tuple[nn.Module, str, nn.Module | None]]:
    """(owner, attribute of the RMSNorm, the one projection that reads its output)."""
    sites = [(l, "input_layernorm", l.self_attn.qkv_proj) for l in model.model.layers]
    sites += [(l, "post_attention_layernorm", l.mlp.gate_up_proj) for l in model.model.layers]
    return sites + [(model.model, "norm", model.lm_head)]


def unfuse(model) -> None:
    """Put every RMSNorm folded into a projection back in its place, and clear glu/glu_out."""
    for owner, attr, lin in norm_sites(model):
        if isinstance(lin, FusedIO) and lin.norm is not None:
            setattr(owner, attr, lin.norm)
            lin.norm = None
    for layer in model.model.layers:
        for lin in (layer.mlp.down_proj, layer.mlp.gate_up_proj):
            if isinstance(lin, FusedIO):
                lin.glu = lin.glu_out = False


def fuse(model, swiglu_at: str) -> None:
    """Fold each RMSNorm into the one projection that reads it, and SwiGLU into down_proj or
    gate_up_proj (swiglu_at: RuntimeOptions.swiglu)."""
    for owner, attr, lin in norm_sites(model):
        if isinstance(lin, FusedIO) and lin.can_fuse():
            lin.norm = getattr(owner, attr)
            setattr(owner, attr, nn.Identity())
    for layer in model.model.layers:
        gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
        if swiglu_at == "gate_up" and isinstance(gate_up, FusedIO) and gate_up.can_fuse() and gate_up.glu_out_ok:
            gate_up.glu_out = True
        elif gate_up is not None and isinstance(down, FusedIO) and down.can_fuse():
            down.glu = True
