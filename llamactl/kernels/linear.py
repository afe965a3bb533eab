"""Linear layers that run batch-1 rows through llamactl's Triton GEMV kernels, and the switch that
puts them (and the split-KV decode attention) into a model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llamactl import kernels


class GemvLinear(nn.Linear):
    """nn.Linear whose single-row inputs go through the Triton GEMV; more rows go to cuBLAS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        if x.numel() != self.in_features:
            return F.linear(x, self.weight, self.bias)
        from llamactl.kernels.gemv import gemv_bf16

        y = gemv_bf16(x.reshape(-1), self.weight)  # [out]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class TritonInt4Linear(nn.Module):
    """y = x W^T with W in 4 bits (groups along the input), in the layout of kernels.gemv.

    Single rows run the int4 GEMV (reads 4 bits a weight); longer inputs (prefill) dequantize the
    layer to 16 bits with a Triton kernel and use cuBLAS.
    """

    def __init__(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, perm: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None, device: torch.device):
        """codes: [out, in] in group order, zeros/scales: [groups, out], perm: [in] or None."""
        super().__init__()
        from llamactl.kernels.gemv import pack_int4

        self.out_features, self.in_features = codes.shape
        self.group_size = group_size
        self.register_buffer("qweight", pack_int4(codes.to(device)))  # [out, in // 8] int32
        self.register_buffer("scales", scales.t().contiguous().to(device=device, dtype=torch.float16))  # [out, groups]
        self.register_buffer("zeros", zeros.t().contiguous().to(device=device, dtype=torch.uint8))  # [out, groups]
        self.register_buffer("perm", None if perm is None else perm.to(device))
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        from llamactl.kernels.gemv import dequantize_int4, gemv_int4

        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if self.perm is not None:
            x2 = x2[:, self.perm]
        if x2.shape[0] <= 8:  # decode: one GEMV per row still reads far fewer bytes than dequantizing
            y = torch.stack([gemv_int4(row.contiguous(), self.qweight, self.scales, self.zeros, self.group_size)
                             for row in x2])
        else:
            y = F.linear(x2, dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def _swap_linear(mod: nn.Linear, cls: type) -> nn.Linear:
    new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
    new.weight = mod.weight
    if mod.bias is not None:
        new.bias = mod.bias
    return new


@torch.no_grad()
def set_kernels(model, on: bool) -> dict[str, str]:
    """Route the model's float linears and decode attention through llamactl's Triton kernels
    (on) or through cuBLAS and SDPA (off). Returns what runs, for reports."""
    on = on and kernels.available(model.device)
    for name, mod in list(model.named_modules()):
        if type(mod) in (nn.Linear, GemvLinear) and mod.weight.is_floating_point():
            cls = GemvLinear if on else nn.Linear
            if type(mod) is not cls:
                parent, _, child = name.rpartition(".")
                owner = model.get_submodule(parent) if parent else model
                setattr(owner, child, _swap_linear(mod, cls))
    hd = model.args.head_dim
    attn_ok = on and hd >= 16 and hd & (hd - 1) == 0
    for layer in model.model.layers:
        layer.self_attn.decode_kernel = attn_ok
    if not on:
        return {"gemv": "cublas", "decode_attention": "sdpa"}
    return {"gemv": f"triton {kernels.triton_version()}", "decode_attention": "triton split-kv" if attn_ok else "sdpa"}
