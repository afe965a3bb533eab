"""Probe PyTorch's int4 (tinygemm) and int8 weight-only matmuls on this GPU: layout and speed.

Prints which nibble order `_convert_weight_to_int4pack` expects here, the relative error against
the dequantized reference, and the time of a batch-1 matrix-vector product against bf16.
"""

import torch
import torch.nn.functional as F
from triton.testing import do_bench

dev, bf16 = "cuda", torch.bfloat16
torch.manual_seed(0)


def int4_pack(q, order):  # q: [N, K] int32 codes 0..15
    hi, lo = (q[:, ::2], q[:, 1::2]) if order == "even-high" else (q[:, 1::2], q[:, ::2])
    return torch.ops.aten._convert_weight_to_int4pack((hi << 4 | lo).to(torch.uint8), 8)


for n, k in [(4096, 4096), (12288, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]:
    g = 128
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
    scale = torch.rand(k // g, n, device=dev, dtype=bf16) * 0.01 + 0.001
    zero = torch.randn(k // g, n, device=dev, dtype=bf16) * 0.01
    sz = torch.stack([scale, zero], dim=-1).contiguous()  # [K/g, N, 2]
    # tinygemm: w = (q - 8) * scale + zero
    w_ref = ((q.view(n, k // g, g) - 8).to(bf16) * scale.t()[:, :, None] + zero.t()[:, :, None]).view(n, k)
    x = torch.randn(1, k, device=dev, dtype=bf16)
    ref = x.float() @ w_ref.float().t()
    for order in ("even-high", "odd-high"):
        try:
            wp = int4_pack(q, order)
            y = torch.ops.aten._weight_int4pack_mm(x, wp, g, sz)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            print(f"int4 {n}x{k} order={order} rel_err={err:.2e}")
            if err < 1e-2:
                t4 = do_bench(lambda: torch.ops.aten._weight_int4pack_mm(x, wp, g, sz), return_mode="median")
        except Exception as e:  # noqa: BLE001
            print(f"int4 {order} failed: {type(e).__name__}: {str(e)[:200]}")
    w16 = w_ref.contiguous()
    t16 = do_bench(lambda: F.linear(x, w16), return_mode="median")
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
    s8 = torch.rand(n, device=dev, dtype=bf16) * 0.01
    lin8 = torch.compile(lambda x: F.linear(x, w8.to(bf16)) * s8)
    lin8(x)
    t8 = do_bench(lambda: lin8(x), return_mode="median")
    gb = n * k * 2 / 1e9
    print(f"{n}x{k}: bf16 {t16*1e3:.1f} us ({gb/t16*1e3:.0f} GB/s) | int8 compiled {t8*1e3:.1f} us "
          f"({t16/t8:.2f}x) | int4 tinygemm {t4*1e3:.1f} us ({t16/t4:.2f}x)")
