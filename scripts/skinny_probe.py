"""The swapped-operand products (kernels.skinny) against cuBLAS and what a decode batch runs
today, per llama2-7b layer shape and rows (GPU).

Usage: python scripts/skinny_probe.py OUT.json [--rows 2,8,32] [--layers qkv,o] [--kinds w16,int8,int4,int4i8]. For each shape (N,
K) and rows M, device us a call (calls in a CUDA graph, multirow_probe.timed) and GB/s of weight
bytes: cublas_bf16, skinny_mm (16-bit), skinny_mm_res (with the residual added; o and down),
multirow_int8, skinny_int8 (int8 per-row scales, the 16-bit MMA) and skinny_int8_mma (the int8 MMA),
multirow_int4 (the split-K kernel), skinny_int4, tinygemm (torch's int4); int4i8: skinny_int4_i8
(the codes on the int8 MMA). Errors against float64
once a shape, and whether 50 replays of a graph of the split kernels give the same bits.
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton
from multirow_probe import timed  # scripts/ is this script's import path

from llamactl.kernels import skinny
from llamactl.kernels.int4_layout import pack_int4
from llamactl.kernels.multirow import multirow_int4, multirow_mm

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
ROWS = [2, 4, 8, 16, 32]
G = 128


def err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def fixed16(x):
    """x [M, K] as skinny_int8 and skinny_int4_i8 multiply it (float64): each row's 128-column
    block scaled by 2^(13 - e), 2^e <= max |x| < 2^(e + 1), rounded, scaled back."""
    m, k = x.shape
    blocks = F.pad(x.double(), (0, -k % 128)).view(m, -1, 128)
    e = torch.frexp(blocks.abs().amax(-1, keepdim=True))[1] - 1
    scale = torch.pow(2.0, (13 - e).double().clamp(max=126))
    return (torch.round(blocks * scale) / scale).view(m, -1)[:, :k]


def replays_agree(fn):
    """A graph of fn replayed 50 times: the same bits each time (the split's fixed summation order)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fn()
    g.replay()
    first = y.clone()
    same = True
    for _ in range(50):
        g.replay()
        same &= bool(torch.equal(y, first))
    return same


def tuned(kernel):
    return {str(k): str(v) for k, v in kernel.cache.items()}


def main(out, rows_probed, layers, kinds):
    torch.manual_seed(0)
    rows, checks = [], []
    for name, (n, k) in SHAPES.items():
        if layers and name not in layers:
            continue
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        codes = torch.randint(0, 16, (n, k), device="cuda", dtype=torch.int32)
        q = pack_int4(codes)
        s = (torch.rand(n, k // G, device="cuda") * 0.01).half()
        z = torch.randint(0, 16, (n, k // G), device="cuda").to(torch.uint8)
        w8 = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        s8 = torch.rand(n, device="cuda", dtype=torch.bfloat16) * 0.01
        wq = (codes.double() - z.double().repeat_interleave(G, 1)) * s.double().repeat_interleave(G, 1)
        u8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
        tg = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
        sz = torch.stack([s.float().t(), ((8 - z.float()) * s.float()).t()], dim=-1).to(torch.bfloat16).contiguous()
        for m in (3, 24):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            c = {"layer": name, "M": m, "cublas_bf16": err(F.linear(x, w16), x.double() @ w16.double().t())}
            if "w16" in kinds:
                c["skinny_mm"] = err(skinny.skinny_mm(x, w16), x.double() @ w16.double().t())
                c["skinny_mm_res_exact"] = bool(torch.equal(skinny.skinny_mm(x, w16, r), r + skinny.skinny_mm(x, w16)))
                c["replays_agree_mm"] = replays_agree(lambda: skinny.skinny_mm(x, w16))
            if "int8" in kinds:
                ref8 = (x.double() @ w8.double().t()) * s8.double()
                c["skinny_int8"] = err(skinny.skinny_mm(x, w8, scales=s8), ref8)
                c["multirow_int8"] = err(multirow_mm(x, w8, s8), ref8)
            if "int4" in kinds:
                c["skinny_int4"] = err(skinny.skinny_int4(x, q, s, z, G), x.double() @ wq.t())
                c["multirow_int4"] = err(multirow_int4(x, q, s, z, G), x.double() @ wq.t())
                c["replays_agree_int4"] = replays_agree(lambda: skinny.skinny_int4(x, q, s, z, G))
            if "int4i8" in kinds:  # against its own x: 16-bit fixed point a 128-column block
                xf = fixed16(x)
                c["skinny_int4_i8"] = err(skinny.skinny_int4_i8(x, q, s, z, G), xf @ wq.t())
                c["skinny_int4_i8_vs_float_x"] = err(skinny.skinny_int4_i8(x, q, s, z, G), x.double() @ wq.t())
                c["replays_agree_int4_i8"] = replays_agree(lambda: skinny.skinny_int4_i8(x, q, s, z, G))
            checks.append(c)
            print(json.dumps(c), flush=True)
        for m in rows_probed:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            t = {"layer": name, "N": n, "K": k, "M": m, "cublas_bf16": timed(lambda: F.linear(x, w16))}
            if "w16" in kinds:
                t["skinny_mm"] = timed(lambda: skinny.skinny_mm(x, w16))
                if name in ("o", "down") and m in (8, 32):
                    t["cublas_bf16_res"] = timed(lambda: res + F.linear(x, w16))
                    t["skinny_mm_res"] = timed(lambda: skinny.skinny_mm(x, w16, res))
            if "int8" in kinds:
                t["multirow_int8"] = timed(lambda: multirow_mm(x, w8, s8))
                t["skinny_int8"] = timed(lambda: skinny.skinny_mm(x, w8, scales=s8))
                t["skinny_int8_mma"] = timed(lambda: skinny.skinny_int8(x, w8, s8))
            if "int4" in kinds:
                t["multirow_int4"] = timed(lambda: multirow_int4(x, q, s, z, G))
                t["skinny_int4"] = timed(lambda: skinny.skinny_int4(x, q, s, z, G))
                t["tinygemm"] = timed(lambda: torch.ops.aten._weight_int4pack_mm(x, tg, G, sz))
            if "int4i8" in kinds:
                t["skinny_int4_i8"] = timed(lambda: skinny.skinny_int4_i8(x, q, s, z, G))
                if "int4" not in kinds:
                    t["skinny_int4"] = timed(lambda: skinny.skinny_int4(x, q, s, z, G))
            for key, b in (("cublas_bf16", 2), ("skinny_mm", 2), ("multirow_int8", 1), ("skinny_int8", 1), ("skinny_int8_mma", 1),
                           ("multirow_int4", 0.5), ("skinny_int4", 0.5), ("skinny_int4_i8", 0.5)):
                if key in t:
                    t[key + "_GBps"] = n * k * b / t[key] / 1e3
            rows.append(t)
            print(json.dumps({k_: (round(v, 1) if isinstance(v, float) else v) for k_, v in t.items()}), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "checks": checks, "rows": rows, "tuned_mm": tuned(skinny._w16_tuned),
               "tuned_int4": tuned(skinny._w4_tuned), "tuned_int4_i8": tuned(skinny._w4i8_tuned),
               "tuned_int8": tuned(skinny._w8_tuned)}, open(out, "w"), indent=1)


if __name__ == "__main__":
    rows_arg = sys.argv[sys.argv.index("--rows") + 1] if "--rows" in sys.argv else None
    layers_arg = sys.argv[sys.argv.index("--layers") + 1].split(",") if "--layers" in sys.argv else None
    kinds_arg = sys.argv[sys.argv.index("--kinds") + 1].split(",") if "--kinds" in sys.argv else ["w16", "int8", "int4"]
    main(sys.argv[1], [int(r) for r in rows_arg.split(",")] if rows_arg else ROWS, layers_arg, kinds_arg)
