"""Which product a prefill's rows should take with 4-bit weights: llama2-7b layer shapes on the GPU.

Usage: python scripts/int4_prefill_probe.py OUT.json [--rows 144,256,...] [--layers qkv,o].
For each shape (N, K) and rows M, device time in us (calls in a CUDA graph) of:
  cublas_bf16     the 16-bit product alone (what bf16 layers run)
  dequant_cublas  dequantize the layer to bf16 (Triton), then cuBLAS (what int4 layers run)
  dequant         the dequantization alone
with the relative error of dequant_cublas against float64 (at the first M). (Commit 034da32 had
an int4 GEMM dequantizing in registers, kernels/int4_gemm.py, timed here too: docs/bench/README.md.)
--dequant: first the dequantization alone per layer, GB/s of int4 read and 16-bit written: the
tiled kernel before 2026-12-05 (32 rows x 256 columns a program, copied here) against the flat one
at each BLOCK words and warps, and a copy of the 16-bit layer (torch) as the bandwidth reference.
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from multirow_probe import timed  # scripts/ is this script's import path

from llamactl.kernels.int4_layout import dequantize_int4, pack_int4

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
ROWS = [144, 256, 512, 1024, 2048, 4608]
G = 128


@triton.jit
def _tiles_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, G: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    # the dequantizing kernel before 2026-12-05 (4 bits): one program per [BLOCK_N, 8 WORDS] tile
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)  # [W]
    kw = tl.multiple_of(K // 8, G // 8)
    ok = (rows < N)[:, None] & (words < kw)[None, :]
    rows64 = rows.to(tl.int64)
    p = tl.load(q_ptr + rows64[:, None] * kw + words[None, :], mask=ok, other=0)  # [BN, W]
    j = tl.arange(0, 8)
    codes = (p[:, :, None] >> (j * 4)[None, None, :]) & 0xF  # [BN, W, 8]
    g_off = rows64[:, None] * (K // G) + (words * 8 // G)[None, :]  # [BN, W]
    s = tl.load(s_ptr + g_off, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_off, mask=ok, other=0).to(tl.float32)
    w = (codes.to(tl.float32) - z[:, :, None]) * s[:, :, None]  # [BN, W, 8]
    cols = words[:, None] * 8 + j[None, :]  # [W, 8]
    tl.store(w_ptr + rows64[:, None, None] * K + cols[None, :, :], w.to(w_ptr.dtype.element_ty), mask=ok[:, :, None])


def _tiles(q, s, z):
    n, k = q.shape[0], q.shape[1] * 8
    w = torch.empty(n, k, dtype=torch.bfloat16, device=q.device)
    _tiles_kernel[(triton.cdiv(n, 32), triton.cdiv(k // 8, 32))](q, s, z, w, n, k, G, BLOCK_N=32, WORDS=32)
    return w


def _layer(n: int, k: int):
    """Random int4 g128 codes in kernels.gemv's layout: (qweight, scales, zeros)."""
    q = pack_int4(torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32))
    s = (torch.rand(n, k // G, device="cuda") * 0.01).half()
    return q, s, torch.randint(0, 16, (n, k // G), device="cuda").to(torch.uint8)


def dequant_sweep(layers=None):
    """The dequantization alone, per layer: the tiled kernel, the flat one per (block, warps), a copy."""
    rows = []
    for name, (n, k) in SHAPES.items():
        if layers and name not in layers:
            continue
        q, s, z = _layer(n, k)
        ref = _tiles(q, s, z)
        gb = (n * k // 2 + n * k * 2) / 1e3  # int4 read, bf16 written: GB/s from us
        w16 = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        r = {"layer": name, "N": n, "K": k, "copy_16bit_gbs": 2 * n * k * 2 / 1e3 / timed(lambda: w16.clone()),
             "tiles_gbs": gb / timed(lambda: _tiles(q, s, z))}
        for block in (256, 512, 1024, 2048, 4096):
            for warps in (4, 8):
                assert torch.equal(dequantize_int4(q, s, z, G, torch.bfloat16, block=block, warps=warps), ref)
                r[f"flat_{block}_{warps}_gbs"] = gb / timed(
                    lambda: dequantize_int4(q, s, z, G, torch.bfloat16, block=block, warps=warps))
        rows.append(r)
        print(json.dumps({k_: (round(v, 1) if isinstance(v, float) else v) for k_, v in r.items()}), flush=True)
    return rows


def main(out, rows_probed, layers=None, dequant=False):
    torch.manual_seed(0)
    sweep = dequant_sweep(layers) if dequant else []
    rows = []
    for name, (n, k) in SHAPES.items():
        if layers and name not in layers:
            continue
        q, s, z = _layer(n, k)
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq = dequantize_int4(q, s, z, G, torch.float32).double()  # [n, k]
        for i, m in enumerate(rows_probed):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = {"layer": name, "N": n, "K": k, "M": m}
            if i == 0:
                ref = x.double() @ wq.t()
                y = F.linear(x, dequantize_int4(q, s, z, G, torch.bfloat16))
                r["errors"] = {"dequant_cublas": ((y.double() - ref).norm() / ref.norm()).item()}
            r.update(cublas_bf16=timed(lambda: F.linear(x, w16)),
                     dequant_cublas=timed(lambda: F.linear(x, dequantize_int4(q, s, z, G, torch.bfloat16))),
                     dequant=timed(lambda: dequantize_int4(q, s, z, G, torch.bfloat16)))
            rows.append(r)
            print(json.dumps({k_: (round(v, 1) if isinstance(v, float) else v) for k_, v in r.items()}), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "dequant": sweep, "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    rows_arg = sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv else None
    layers_arg = sys.argv[sys.argv.index("--layers") + 1].split(",") if "--layers" in sys.argv else None
    main(sys.argv[1], [int(r) for r in rows_arg.split(",")] if rows_arg else ROWS, layers_arg, "--dequant" in sys.argv)
