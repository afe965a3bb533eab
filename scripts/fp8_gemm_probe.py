"""FP8 products against bf16 ones, product by product (issue 53): llama3-8b's (or llama2-7b's)
linear shapes at each row count, timed in CUDA graphs over enough weight copies that L2 cannot
serve them. Variants of torch._scaled_mm (cuBLASLt / CUTLASS): scales per row of x and per
column of W (what layers.fp8 runs), the same with fast accumulation, one scale each (per tensor)
with fast accumulation; and the activations' per-row quantization alone (kernels.fp8.quantize_rows,
the kernel before each product). Each row: microseconds, the weights' TB/s, TFLOP/s, the ratio to
bf16's time, and the relative error against a float32 product of the same FP8 inputs.

Usage: python scripts/fp8_gemm_probe.py OUT.json [--shapes llama3-8b] [--rows 1,16,64,128,256,2048]
"""

from __future__ import annotations

import argparse
import json

import torch

from llamactl.kernels import fp8 as fp8_kernels
from llamactl.runtime.graphs import replay_seconds

SHAPES = {  # (name, in, out) of a decoder layer's products, the fused ones as llamactl runs them
    "llama3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)],
    "llama2-7b": [("qkv", 4096, 12288), ("o", 4096, 4096), ("gate_up", 4096, 22016), ("down", 11008, 4096)],
}
E4M3 = torch.float8_e4m3fn


def per_row(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (e4m3 [R, C], float32 scales [R, 1]): each row's largest magnitude at 448."""
    s = (t.float().abs().amax(-1, keepdim=True) / torch.finfo(E4M3).max).clamp(min=1e-12)
    return (t.float() / s).to(E4M3), s


def variants(x: torch.Tensor, ws: list[torch.Tensor]):
    """(name, [callables, one a weight copy], the first copy's output) for x [M, K], ws [N, K] bf16."""
    xq, xs = per_row(x)
    wqs = [per_row(w) for w in ws]  # [N, K] e4m3, [N, 1]
    xt, wt = xs.max(), [s.max() for _, s in wqs]  # one scale a tensor (the largest row's)
    xq_t = (x.float() / xt).to(E4M3)
    wq_t = [(w.float() / s).to(E4M3) for w, s in zip(ws, wt)]

    def rowwise(i, fast):
        wq, s = wqs[i]
        return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

    def tensorwise(i):
        return lambda: torch._scaled_mm(xq_t, wq_t[i].t(), scale_a=xt, scale_b=wt[i], out_dtype=torch.bfloat16,
                                        use_fast_accum=True)

    yield "bf16 (cuBLAS)", [lambda w=w: x @ w.t() for w in ws], None
    yield "fp8 rows x columns", [rowwise(i, False) for i in range(len(ws))], (xq.float() * xs) @ (
        wqs[0][0].float() * wqs[0][1]).t()
    yield "fp8 rows x columns, fast accumulation", [rowwise(i, True) for i in range(len(ws))], (xq.float() * xs) @ (
        wqs[0][0].float() * wqs[0][1]).t()
    yield "fp8 per tensor, fast accumulation", [tensorwise(i) for i in range(len(ws))], (xq_t.float() * xt) @ (
        wq_t[0].float() * wt[0]).t()
    yield "x's per-row quantization alone", [lambda: fp8_kernels.quantize_rows(x)], None


def probe(shape: str, rows: list[int]) -> list[dict]:
    out = []
    for name, k, n in SHAPES[shape]:
        copies = max(2, int(1.5e9 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = None
            for vname, fns, ref in variants(x, ws):
                try:
                    t = replay_seconds(fns)
                    err = None
                    if ref is not None:
                        y = fns[0]().float()
                        err = ((y - ref).norm() / ref.norm()).item()
                except Exception as e:  # a variant this torch or GPU does not run: say so, go on
                    out.append({"shape": shape, "product": name, "rows": m, "variant": vname,
                                "error": f"{type(e).__name__}: {str(e)[:160]}"})
                    continue
                base = base or t
                w_bytes = n * k * (2 if vname.startswith("bf16") else 1)
                row = {"shape": shape, "product": name, "rows": m, "variant": vname, "us": t * 1e6,
                       "vs_bf16": t / base, "rel_err": err}
                if not vname.startswith("x's"):
                    row |= {"weights_tb_s": w_bytes / t / 1e12, "tflop_s": 2 * m * n * k / t / 1e12}
                out.append(row)
                print(f"{shape} {name:8} {m:5} rows  {vname:40} {t * 1e6:8.1f} us  {t / base:5.2f}x bf16"
                      + (f"  err {err:.1e}" if err is not None else ""), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="llama3-8b")
    ap.add_argument("--rows", default="1,16,64,128,256,2048")
    a = ap.parse_args()
    runs = []
    for shape in a.shapes.split(","):
        runs += probe(shape, [int(r) for r in a.rows.split(",")])
        with open(a.out, "w") as f:  # after each shape: a time limit keeps what was measured
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": runs}, f, indent=1)


if __name__ == "__main__":
    main()
