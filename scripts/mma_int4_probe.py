"""The int4 products of decode batches on the GPU (issue 51): for the layers of one decoder layer of
llama2-7b and llama3-8b (q/k/v fused, o, gate/up fused, down), random int4 g128 codes, each row
count: cuBLAS bf16, the tensor-core kernel (kernels/mma_int4.py) and with --triton llamactl's
Triton int4 layer (what decode batches run today: the skinny, multirow or dequantize + cuBLAS path
its forward picks; autotuned at its first call, minutes on a fresh machine), each replayed from a
CUDA graph; us a decoder layer, and the kernel's
products checked against its float reference (`emulate`) first. With --steps SHAPE: then whole
decode steps of that shape in int4 (RTN g128, graphs mode) at each row count with the Triton kernels
and with the tensor-core kernel (RuntimeOptions.int4_mma), alternating, and bf16's. Writes OUT.json
as it goes.

Usage: python scripts/mma_int4_probe.py OUT.json [--rows 1,2,4,8,16,32,64] [--shapes llama2-7b,llama3-8b] [--triton] [--steps llama2-7b]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llamactl.kernels import mma_int4 as mi
from llamactl.layers.int4 import int4_linear

SHAPES = {  # (name, out, in) of one decoder layer's products
    "llama2-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)],
    "llama3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
GROUP, REPS = 128, 200


def timed(fn) -> float:
    """us a call of fn, replayed from a CUDA graph (after a warm call)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPS):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / REPS * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b")
    ap.add_argument("--triton", action="store_true")
    ap.add_argument("--steps", default=None, help="a synthetic shape whose whole decode steps to time")
    a = ap.parse_args()
    dev = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel": mi.available() or "built",
              "rows": {}, "check": {}}
    rows = [int(r) for r in a.rows.split(",")]
    for shape in a.shapes.split(","):
        layers = []
        for name, n, k in SHAPES[shape]:
            codes = torch.randint(0, 16, (n, k), device=dev)
            zeros = torch.randint(0, 16, (k // GROUP, n), device=dev).float()
            scales = (torch.rand(k // GROUP, n, device=dev) * 0.02 + 0.001).to(torch.bfloat16).float()
            w = ((codes.float() - zeros.t().repeat_interleave(GROUP, 1)) * scales.t().repeat_interleave(GROUP, 1)).to(torch.bfloat16)
            tri = (int4_linear(codes, zeros, scales.half(), torch.arange(k, device=dev) // GROUP, GROUP, None, dev, True)
                   if a.triton else None)
            qw, sz = mi.pack(codes, zeros, scales, GROUP)
            layers.append((name, n, k, w, tri, qw, sz))
            if result["kernel"] == "built" and name == "o":  # the kernel's sums against its reference
                x = torch.randn(33, k, device=dev).to(torch.bfloat16)
                want = mi.emulate(x.cpu(), qw.cpu(), sz.cpu(), GROUP)
                got = mi.mma_int4(x, qw, sz, GROUP).float().cpu()
                result["check"][shape] = {"max_abs_err": (got - want).abs().max().item(),
                                          "mean_abs": want.abs().mean().item()}
                print(shape, "check", result["check"][shape], flush=True)
        per = result["rows"].setdefault(shape, {})
        for m in rows:
            x = {k: torch.randn(m, k, device=dev).to(torch.bfloat16) for _, _, k, *_ in layers}
            row = {"bf16": sum(timed(lambda: torch.nn.functional.linear(x[k], w)) for _, _, k, w, *_ in layers)}
            if a.triton:
                row["triton_int4"] = sum(timed(lambda: tri(x[k])) for _, _, k, _, tri, *_ in layers)
                row["triton_vs_bf16"] = row["bf16"] / row["triton_int4"]
            if result["kernel"] == "built" and m <= mi.MAX_ROWS:
                row["mma_int4"] = sum(timed(lambda: mi.mma_int4(x[k], qw, sz, GROUP)) for _, _, k, _, _, qw, sz in layers)
                row["mma_vs_bf16"] = row["bf16"] / row["mma_int4"]
            per[m] = row
            print(shape, m, {k: round(v, 2) for k, v in row.items()}, flush=True)
            with open(a.out, "w") as fh:
                json.dump(result, fh, indent=1)
    if a.steps:
        result["steps"] = decode_steps(a.steps, rows, lambda: _write(a.out, result))
        _write(a.out, result)


def _write(path: str, result: dict) -> None:
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)


def step_ms(dec, tok: torch.Tensor) -> tuple[float, tuple]:
    """ms a decode step of dec (its own CUDA graph) at position 128, after three warm steps."""
    for _ in range(3):
        dec.step(tok, 128)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPS):
        dec.step(tok, 128)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / REPS * 1e3, dec.plan.warnings


def decode_steps(shape: str, rows: list[int], save) -> dict:
    """ms a decode step of the synthetic shape at each row count: bf16, int4 on the Triton kernels,
    int4 on the tensor-core kernel (twice each, alternating)."""
    from llamactl.bench.targets import load_targets
    from llamactl.options import RuntimeOptions
    from llamactl.runtime.step import Decoder

    dev = torch.device("cuda")
    out: dict = {}
    for quant in ("none", "int4"):
        model = load_targets([], shape, dev, "bfloat16", quant)[0].model
        for m in rows:
            tok = torch.zeros(m, dtype=torch.long, device=dev)
            sides = [("bf16", False)] if quant == "none" else [("triton", False), ("mma", True)] * 2
            for name, mma in sides:
                ms, warnings = step_ms(Decoder(model, m, 256, "graphs", options=RuntimeOptions(int4_mma=mma)), tok)
                out.setdefault(str(m), {}).setdefault(name, []).append(ms)
                print(shape, m, name, round(ms, 3), warnings, flush=True)
                save()
        del model
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
