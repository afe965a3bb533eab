"""The low-bit products of decode batches on the GPU (issue 51): for the layers of one decoder layer
of llama2-7b and llama3-8b (q/k/v fused, o, gate/up fused, down), random int4 g128 and int8
per-channel codes (--bits), each row count: cuBLAS bf16, the tensor-core kernel (kernels/mma.py)
and with --triton llamactl's Triton layer (what decode batches run today: the skinny, multirow or
dequantize + cuBLAS path its forward picks; autotuned at its first call, minutes on a fresh
machine), each replayed from a CUDA graph; us a decoder layer, and the kernel's products checked
against its float reference (`emulate`) first. With --steps SHAPE: then whole decode steps of that
shape in each of the bits (RTN, graphs mode) at each row count with the Triton kernels and with the
tensor-core kernel (RuntimeOptions.mma), alternating, and bf16's. Writes OUT.json as it goes.

Usage: python scripts/mma_probe.py OUT.json [--bits 4,8] [--rows 1,2,4,8,16,32,64] [--shapes llama2-7b,llama3-8b] [--triton] [--steps llama2-7b]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from llamactl.kernels import mma as mi
from llamactl.layers.int4 import int4_linear
from llamactl.layers.int8 import Int8Kernel

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
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b")
    ap.add_argument("--triton", action="store_true")
    ap.add_argument("--steps", default=None, help="a synthetic shape whose whole decode steps to time")
    a = ap.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel": mi.available() or "built",
              "rows": {}, "check": {}}
    rows, bits = [int(r) for r in a.rows.split(",")], [int(b) for b in a.bits.split(",")]
    for shape in a.shapes.split(","):
        for b in bits:
            products(result, f"{shape} int{b}", [_layer(n, k, b, a.triton) for _, n, k in SHAPES[shape]], rows)
            _write(a.out, result)
    if a.steps:
        result["steps"] = decode_steps(a.steps, rows, bits, lambda: _write(a.out, result))
        _write(a.out, result)


def _layer(n: int, k: int, bits: int, triton: bool) -> tuple:
    """(k, the bf16 weight, the Triton layer or None, qw, sz, group) of random codes: int4 in groups
    of GROUP, int8 one group a row (per channel, symmetric as llamactl's int8 layers)."""
    dev = torch.device("cuda")
    group = GROUP if bits == 4 else k
    codes = torch.randint(0, 2**bits, (n, k), device=dev)
    zeros = (torch.randint(0, 16, (k // group, n), device=dev).float() if bits == 4
             else torch.full((1, n), 128.0, device=dev))
    scales = (torch.rand(k // group, n, device=dev) * 0.02 + 0.001).to(torch.bfloat16).float()
    w = ((codes.float() - zeros.t().repeat_interleave(group, 1)) * scales.t().repeat_interleave(group, 1)).to(torch.bfloat16)
    tri = None
    if triton:
        tri = (int4_linear(codes, zeros, scales.half(), torch.arange(k, device=dev) // group, group, None, dev, True)
               if bits == 4 else Int8Kernel(codes - 128, scales[0], None, True))
    return (k, w, tri, *mi.pack(codes, zeros, scales, group, torch.bfloat16, bits), group)


def products(result: dict, name: str, layers: list[tuple], rows: list[int]) -> None:
    """us one decoder layer's products at each row count: bf16, the Triton layer, the kernel."""
    if result["kernel"] == "built":  # the kernel's sums against its reference (the o projection)
        k, _, _, qw, sz, group = layers[1]
        x = torch.randn(33, k, device="cuda").to(torch.bfloat16)
        want = mi.emulate(x.cpu(), qw.cpu(), sz.cpu(), group)
        got = mi.mma(x, qw, sz, group).float().cpu()
        result["check"][name] = {"max_abs_err": (got - want).abs().max().item(), "mean_abs": want.abs().mean().item()}
        print(name, "check", result["check"][name], flush=True)
    per = result["rows"].setdefault(name, {})
    for m in rows:
        x = {k: torch.randn(m, k, device="cuda").to(torch.bfloat16) for k, *_ in layers}
        row = {"bf16": sum(timed(lambda: torch.nn.functional.linear(x[k], w)) for k, w, *_ in layers)}
        if layers[0][2] is not None:
            row["triton"] = sum(timed(lambda: tri(x[k])) for k, _, tri, *_ in layers)
            row["triton_vs_bf16"] = row["bf16"] / row["triton"]
        if result["kernel"] == "built" and m <= mi.MAX_ROWS:
            row["mma"] = sum(timed(lambda: mi.mma(x[k], qw, sz, g)) for k, _, _, qw, sz, g in layers)
            row["mma_vs_bf16"] = row["bf16"] / row["mma"]
        per[m] = row
        print(name, m, {k: round(v, 2) for k, v in row.items()}, flush=True)


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


def decode_steps(shape: str, rows: list[int], bits: list[int], save) -> dict:
    """ms a decode step of the synthetic shape at each row count: bf16, each of the bits on the
    Triton kernels and on the tensor-core kernel (twice each, alternating)."""
    from llamactl.bench.targets import load_targets
    from llamactl.options import RuntimeOptions
    from llamactl.runtime.step import Decoder

    dev = torch.device("cuda")
    out: dict = {}
    for quant in ["none"] + [f"int{b}" for b in bits]:
        model = load_targets([], shape, dev, "bfloat16", quant)[0].model
        for m in rows:
            tok = torch.zeros(m, dtype=torch.long, device=dev)
            sides = [("bf16", False)] if quant == "none" else [(f"{quant} triton", False), (f"{quant} mma", True)] * 2
            for name, mma in sides:
                ms, warnings = step_ms(Decoder(model, m, 256, "graphs", options=RuntimeOptions(mma=mma)), tok)
                out.setdefault(str(m), {}).setdefault(name, []).append(ms)
                print(shape, m, name, round(ms, 3), warnings, flush=True)
                save()
        del model
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
