"""FP8 (e4m3) linear layers: weights [out, in] in float8_e4m3fn with a scale per output channel
(compressed-tensors' float-quantized checkpoints: quantize.fp8 writes them, layers.formats reads
them), activations quantized per token when they are multiplied in FP8.

What multiplies x [rows, in]:
- one row where llamactl's kernels run: its GEMV (kernels.gemv), which reads the 8-bit weights and
  converts them in registers (the bytes of int8, the scales applied per row);
- with use_mma (RuntimeOptions.mma, an experiment of issue 53), 2 to 64 rows of bf16 or fp16 on
  the tensor-core kernel (kernels.mma): the weights read as they are and converted in registers,
  the activations not rounded (W8, as the one row);
- more rows on a GPU with FP8 tensor cores (compute capability 8.9: Ada, Hopper): x quantized to
  e4m3 with a scale per row (its largest magnitude over 448; one Triton kernel, kernels.fp8), then
  torch._scaled_mm (cuBLASLt) with the two scale vectors, out in the activations' dtype;
- elsewhere: the weights dequantized to the activations' dtype (on the CPU once, `keep_dense`; on
  older GPUs each call), and more than one row rounded per token as scaled_mm's inputs are, so a
  quality report measured there is W8A8's (layers.plan warns; `product` names the path).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from llamactl.layers.fused import FusedIO
from llamactl.layers.mma import MmaCodes

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


@functools.lru_cache(maxsize=None)
def fp8_matmul(device_index: int) -> bool:
    """Whether torch._scaled_mm runs FP8 here: a CUDA device of compute capability 8.9 or later."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device_index) >= (8, 9)


def quantize_fp8(w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn codes [out, in], scales [out, 1] in scale_dtype): w ~ codes * scales,
    a scale per output channel (its largest magnitude over 448). The codes divide by the stored
    (rounded) scale, so dequantizing reproduces them exactly."""
    amax = w.detach().abs().amax(1, keepdim=True).float()
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny).to(scale_dtype)
    codes = (w.float() / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]): x ~ q * scale, per row (token);
    the weights' rounding with float32 scales."""
    return quantize_fp8(x, torch.float32)


class FP8Linear(nn.Module, FusedIO, MmaCodes):
    """y = x (W * scale)^T + bias, W float8_e4m3fn [out, in], weight_scale [out, 1] (the
    checkpoint's names). `gemv` (llamactl's kernels run) and `scaled_mm` (FP8 tensor cores) are
    set by `use_fp8_kernels` once the weights are on their device. The RMSNorm before it and the
    SwiGLU of down_proj's input (FusedIO's norm and glu) are folded into the GEMV, and into the
    kernel that quantizes the activations for scaled_mm: no pass of their own over the rows."""

    glu_out_ok = False  # SwiGLU on down_proj's input, where the activations' quantization folds it
    mma_kind = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool, scale_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=scale_dtype))
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.gemv = False
        self.scaled_mm = False
        self._init_fused_io()
        self.dense: torch.Tensor | None = None  # keep_dense's weights

    @classmethod
    def concat(cls, mods: list["FP8Linear"]) -> "FP8Linear | None":
        """One layer computing the outputs of `mods` (same input) side by side."""
        if any((m.bias is None) != (mods[0].bias is None) for m in mods):
            return None
        with torch.device("meta"):  # buffers assigned below: nothing allocated twice
            out = cls(mods[0].in_features, sum(m.out_features for m in mods), mods[0].bias is not None,
                      mods[0].weight_scale.dtype)
        out.weight = torch.cat([m.weight.view(torch.uint8) for m in mods]).view(torch.float8_e4m3fn)  # no fp8 cat on the CPU
        out.weight_scale = torch.cat([m.weight_scale for m in mods])
        if out.bias is not None:
            out.bias = nn.Parameter(torch.cat([m.bias for m in mods]), requires_grad=False)
        out.gemv, out.scaled_mm, out.pdl = mods[0].gemv, mods[0].scaled_mm, mods[0].pdl
        return out

    def _mma_shape(self) -> tuple[int, int, int]:
        return self.out_features, self.in_features, self.in_features  # one scale a row

    def _mma_codes(self):
        return self.weight, None, self.weight_scale.float().view(1, -1)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W * scale: [out, in] in dtype."""
        if self.dense is not None and self.dense.dtype == dtype:
            return self.dense
        return (self.weight.to(torch.float32) * self.weight_scale.float()).to(dtype)

    def keep_dense(self, dtype: torch.dtype) -> None:
        """Hold the weights dequantized to dtype (the CPU, where no product reads FP8: converting
        them each call cost 20x the decode step of the 16-bit model)."""
        if self.dense is None or self.dense.dtype != dtype:
            self.dense = None
            self.dense = self.dequantized(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., in] ([..., 2 in] with glu; before the RMSNorm with norm), residual: [..., out] or
        # None -> [..., out] ([..., out / 2] with glu_out)
        shape, width = x.shape, self._input_width()
        rows = x.numel() // width
        if self.gemv and rows == 1:
            from llamactl.kernels.gemv import gemv

            fold = residual is not None and x.dtype == torch.bfloat16  # (the GEMV adds in bfloat16)
            y = gemv(x.reshape(-1).to(torch.bfloat16), self.weight, self.weight_scale.view(-1), *self._norm_args(),
                     residual.reshape(-1) if fold else None, self.glu, self.glu_out, "float", self.pdl,
                     self.pins).view(*shape[:-1], self._output_width()).to(x.dtype)
            y = y if self.bias is None else y + self.bias.to(y.dtype)
            return y if residual is None or fold else residual + y
        if self._mma_takes(rows, x.dtype):
            y = self._mma(self._unfused_input(x).reshape(-1, self.in_features))  # the weights' bytes, once for all rows
            y = y.view(*shape[:-1], self.out_features)
            y = y if self.bias is None else y + self.bias.to(y.dtype)
        elif self.scaled_mm:
            from llamactl.kernels.fp8 import quantize_rows as quantize_rows_kernel

            xq, xs = quantize_rows_kernel(x.reshape(-1, width), *self._norm_args(), glu=self.glu)
            # row-wise scales give bfloat16 only (cuBLASLt): a float16 model converts the product
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale.float().view(1, -1),
                                 out_dtype=torch.bfloat16).view(*shape[:-1], self.out_features).to(x.dtype)
            y = y if self.bias is None else y + self.bias.to(y.dtype)
        else:  # the activations rounded as scaled_mm's would be (rows > 1), so quality measured here is W8A8's
            x = self._unfused_input(x)
            if rows > 1:
                xq, xs = quantize_rows(x.reshape(-1, self.in_features))
                x = (xq.float() * xs).to(x.dtype).view(*shape[:-1], self.in_features)
            y = F.linear(x, self.dequantized(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        y = self._unfused_output(y)
        return y if residual is None else residual + y

    def product(self, rows: int) -> str:
        """What multiplies `rows` rows (bench rows name it)."""
        if self.gemv and rows == 1:
            return "fp8 weights GEMV"
        if self._mma_takes(rows):
            return "fp8 weights tensor-core MMA"
        if self.scaled_mm:
            return "fp8 scaled_mm (cuBLASLt)"
        return "fp8 dequantized at start" if self.dense is not None else "fp8 dequantized per call"


def use_fp8_kernels(model) -> str | None:
    """Point every FP8Linear of model (any module) at FP8 tensor cores where the device has them (layers.plan.prepare
    chooses the one-row GEMV); returns the load's label (None: no FP8 layers)."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    if not layers:
        return None
    dev = layers[0].weight.device
    mm = dev.type == "cuda" and fp8_matmul(dev.index if dev.index is not None else torch.cuda.current_device())
    for m in layers:
        m.scaled_mm = mm
    return "fp8 scaled_mm" if mm else "fp8 dequantized"
