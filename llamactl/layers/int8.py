"""int8 weight-only layers through PyTorch's `_weight_int8pack_mm` (per-output-channel scales).

Where llamactl's kernels run, batch-1 rows go through its int8 GEMV (kernels.gemv) instead; a
decode batch of 2 to skinny.LAYER_ROWS 16-bit rows with int16 inputs (the GEMV's default) through
skinny_int8 (the weights on the integer MMA as they are, x in the GEMV's 16-bit fixed point; the
norm before, SwiGLU and the residual folded in); other batches of up to 64 rows through the
multi-row kernel (kernels.multirow). With use_mma (RuntimeOptions.mma), 2 to 64 rows run the
tensor-core kernel (kernels.mma) on a second copy of the codes in its layout, unfused.

Per-channel int8 layers are repacked at load when activations are bf16: LLM.int8 checkpoints
(int8 rows, scale SCB / 127) and symmetric 8-bit GPTQ/RTN checkpoints with one group per row
(code - 128, scale). Where this torch has no kernel for the device, the layer keeps its
dequantizing path: `torch_kernel` probes the operator once per device type.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from llamactl.layers.bnb import Int8Linear
from llamactl.layers.fused import FusedIO
from llamactl.layers.gptq import GPTQLinear, unpack_rows
from llamactl.layers.mma import MmaCodes


def available(device_type: str, triton: bool) -> bool:
    """Whether int8 layers have a fast path: torch's kernel on this device type, or llamactl's GEMV
    (`triton`: layers.plan.kernels_run)."""
    return triton or torch_kernel(device_type)


@functools.lru_cache(maxsize=None)
def torch_kernel(device_type: str) -> bool:
    try:
        w = torch.ones(8, 32, dtype=torch.int8, device=device_type)
        y = torch.ops.aten._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16, device=device_type), w,
                                               torch.ones(8, dtype=torch.bfloat16, device=device_type))
        return bool(torch.allclose(y.float(), torch.full((1, 8), 32.0, device=device_type)))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class Int8Kernel(nn.Module, FusedIO, MmaCodes):
    """y = (x W^T) * scale with W int8 [out, in] and scale [out]; bf16 activations."""

    mma_kind = "int8"

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, triton: bool):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # fresh, aligned allocations: the CPU kernel crashed on an int8 tensor read straight from a
        # safetensors file (seen with torch 2.13)
        self.register_buffer("weight", weight.to(torch.int8).clone(memory_format=torch.contiguous_format))
        self.register_buffer("scales", scales.to(torch.bfloat16).clone(memory_format=torch.contiguous_format))
        self.bias = None if bias is None else nn.Parameter(bias.to(torch.bfloat16), requires_grad=False)
        self.triton = triton  # batch-1 rows through llamactl's GEMV
        # torch's int8 kernel on this device, probed here: a probe inside a compiled step would break its graph
        self.torch_mm = not triton and torch_kernel(weight.device.type)
        self.inputs = "float"  # what the batch-1 GEMV multiplies the weights with (RuntimeOptions.quant_inputs)
        self._init_fused_io()

    def can_fuse(self) -> bool:
        return self.bias is None and self.triton

    @classmethod
    def concat(cls, mods: list["Int8Kernel"]) -> "Int8Kernel | None":
        """One layer computing the outputs of `mods` (same input) side by side."""
        if any((m.bias is None) != (mods[0].bias is None) for m in mods):
            return None
        bias = None if mods[0].bias is None else torch.cat([m.bias for m in mods])
        return cls(torch.cat([m.weight for m in mods]), torch.cat([m.scales for m in mods]), bias, mods[0].triton)

    def _skinny_takes(self, rows: int) -> bool:
        return self.inputs == "int16" and super()._skinny_takes(rows)  # skinny_int8's x: the GEMV's int16 inputs

    def _mma_shape(self) -> tuple[int, int, int]:
        return self.out_features, self.in_features, self.in_features  # one group a row

    def _mma_codes(self):
        ones = torch.ones(1, self.out_features, device=self.weight.device)
        return self.weight.to(torch.int32) + 128, ones * 128, self.scales.float()[None]

    def use_mma(self, on: bool, dtype: torch.dtype = torch.bfloat16) -> None:
        super().use_mma(on, torch.bfloat16)  # its products take bf16 activations whatever the model's dtype

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] ([..., 2 in] with glu), residual: [..., out] or None -> [..., out]
        if self.triton and x.numel() == self._input_width():
            from llamactl.kernels.gemv import gemv

            y = gemv(x.reshape(-1).to(torch.bfloat16), self.weight, self.scales, *self._norm_args(),
                     None if residual is None else residual.reshape(-1).to(torch.bfloat16), self.glu,
                     self.glu_out, self.inputs, self.pdl, self.pins)  # batch-1 decode
            y = y.view(*x.shape[:-1], self._output_width()).to(x.dtype)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        rows = self._skinny_rows(x) if self.mma is None else 0
        if rows:  # a decode batch: the weights read once for all rows, SwiGLU and the residual folded in
            from llamactl.kernels.skinny import skinny_int8

            x2, r2 = self._skinny_io(x, rows, residual)
            y = skinny_int8(x2, self.weight, self.scales, r2, self.glu, pdl=self.pdl)
            return self._skinny_out(y, x.shape, residual)
        shape, dtype = x.shape, x.dtype
        x2 = self._unfused_input(x).reshape(-1, self.in_features).to(torch.bfloat16)
        from llamactl.kernels.multirow import MAX_ROWS

        if self._mma_takes(x2.shape[0], x2.dtype):
            y = self._mma(x2)  # a decode batch on the tensor cores
        elif self.triton and x2.shape[0] <= MAX_ROWS:  # a decode batch: the weights read once for all rows
            from llamactl.kernels.multirow import multirow_mm

            y = multirow_mm(x2, self.weight, self.scales)
        elif self.torch_mm:  # torch's CUDA kernel is slow for prefill
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        else:  # prefill on CUDA: dequantize the layer for cuBLAS
            y = torch.nn.functional.linear(x2, self.weight.to(torch.bfloat16)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        y = self._unfused_output(y.view(*shape[:-1], self.out_features).to(dtype))
        return y if residual is None else residual + y

    def product(self, rows: int) -> str:
        """What multiplies `rows` rows (bench rows name it)."""
        from llamactl.kernels.multirow import MAX_ROWS

        if self.triton:
            if rows == 1:
                return "int8 GEMV"
            if self._mma_takes(rows):
                return "int8 tensor-core MMA"
            if self._skinny_takes(rows):
                return "int8 skinny"
            return "int8 multirow" if rows <= MAX_ROWS else "int8 dequantize + cuBLAS"
        return "int8 torch int8pack" if self.torch_mm else "int8 dequantize + cuBLAS"


def _from_module(mod, triton: bool) -> Int8Kernel | None:
    if isinstance(mod, Int8Linear):
        return Int8Kernel(mod.weight, mod.SCB.float() / 127.0, mod.bias, triton)
    if isinstance(mod, GPTQLinear) and mod.bits == 8 and mod.scales.shape[0] == 1:
        zeros = unpack_rows(mod.qzeros.t().contiguous(), 8, mod.out_features).t()  # [1, out]
        if mod.v1:
            zeros = (zeros + 1) & 0xFF
        if not bool((zeros == 128).all()):
            return None  # asymmetric: zero points are not expressible here
        codes = unpack_rows(mod.qweight, 8, mod.in_features).t()  # [out, in], in 0..255
        return Int8Kernel(codes - 128, mod.scales[0].float(), mod.bias, triton)
    return None


@torch.no_grad()
def use_int8_kernels(model, triton: bool) -> int:
    """Swap per-channel int8 layers for Int8Kernel where there is a kernel for them (llamactl's
    where `triton`, else torch's); returns how many."""
    if not available(model.device.type, triton):
        return 0
    n = 0
    for name, mod in list(model.named_modules()):
        fast = _from_module(mod, triton)
        if fast is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, fast)
            n += 1
    return n
