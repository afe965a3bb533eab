"""The low-bit products of decode batches on the GPU (issues 51 and 53): for the layers of one
decoder layer of llama2-7b and llama3-8b (q/k/v fused, o, gate/up fused, down), random int4 g128,
int8 per-channel and FP8 per-channel weights (--kinds), each row count: cuBLAS bf16, the
tensor-core kernel (kernels/mma.py) and with --triton llamactl's layer as it runs today (int4 /
int8: the skinny, multirow or dequantize + cuBLAS path its forward picks, autotuned at its first
call, minutes on a fresh machine; FP8: scaled_mm after the activations' quantization), each
replayed from a CUDA graph; us a decoder layer, and the kernel's products checked against its
float reference (`emulate`) first. With --steps SHAPE: then whole decode steps of that shape in
each kind (RTN, graphs mode) at each row count with today's kernels and with the tensor-core
kernel (RuntimeOptions.mma), alternating, and bf16's. Writes OUT.json as it goes.

With --splits F,..: instead of the products, the kernel's at each split-K factor beside its default.
With --source PATH: that mma.cu (e.g. `git show COMMIT:llamactl/kernels/mma.cu`) instead of this tree's.

Usage: python scripts/mma_probe.py OUT.json [--kinds int4,int8,fp8] [--rows 1,2,4,8,16,32,64] [--shapes llama2-7b,llama3-8b] [--triton] [--steps llama2-7b] [--splits 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from llamactl.kernels import mma as mi
from llamactl.layers.fp8 import FP8Linear, quantize_fp8
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
    ap.add_argument("--kinds", default="int4,int8,fp8")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default="llama2-7b,llama3-8b")
    ap.add_argument("--triton", action="store_true")
    ap.add_argument("--steps", default=None, help="a synthetic shape whose whole decode steps to time")
    ap.add_argument("--splits", default=None, help="split-K factors to time the kernel's products at (1,2,4,...)")
    ap.add_argument("--source", default=None, help="another mma.cu to build and time instead (an older tree's)")
    a = ap.parse_args()
    if a.source:
        mi.SOURCE = Path(a.source)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernel": mi.available() or "built",
              "rows": {}, "check": {}}
    rows, kinds = [int(r) for r in a.rows.split(",")], a.kinds.split(",")
    for shape in a.shapes.split(","):
        for kind in kinds:
            layers = [_layer(n, k, kind, a.triton) for _, n, k in SHAPES[shape]]
            if a.splits:
                split_sweep(result, f"{shape} {kind}", layers, rows, [int(v) for v in a.splits.split(",")])
            else:
                products(result, f"{shape} {kind}", layers, rows)
            _write(a.out, result)
    if a.steps:
        decode_steps(a.steps, rows, kinds, result.setdefault("steps", {}), lambda: _write(a.out, result))
        _write(a.out, result)


def _layer(n: int, k: int, kind: str, triton: bool) -> tuple:
    """(k, the bf16 weight, today's layer or None, qw, sz, group, kind) of random weights: int4 in
    groups of GROUP, int8 and FP8 one group a row (per channel; int8 symmetric as llamactl's)."""
    dev = torch.device("cuda")
    if kind == "fp8":
        codes, scale = quantize_fp8(torch.randn(n, k, device=dev) * 0.02)
        zeros, scales, group = None, scale.float().view(1, -1), k
        w = (codes.float() * scales.t()).to(torch.bfloat16)
    else:
        group = GROUP if kind == "int4" else k
        codes = torch.randint(0, 2 ** mi.KINDS[kind], (n, k), device=dev)
        zeros = (torch.randint(0, 16, (k // group, n), device=dev).float() if kind == "int4"
                 else torch.full((1, n), 128.0, device=dev))
        scales = (torch.rand(k // group, n, device=dev) * 0.02 + 0.001).to(torch.bfloat16).float()
        w = ((codes.float() - zeros.t().repeat_interleave(group, 1)) * scales.t().repeat_interleave(group, 1)).to(torch.bfloat16)
    today = None
    if triton and kind == "int4":
        today = int4_linear(codes, zeros, scales.half(), torch.arange(k, device=dev) // group, group, None, dev, True)
    elif triton and kind == "int8":
        today = Int8Kernel(codes - 128, scales[0], None, True)
    elif triton:
        today = FP8Linear(k, n, False).to(dev)
        today.weight, today.weight_scale, today.scaled_mm = codes, scale, True
    return (k, w, today, *mi.pack(codes, zeros, scales, group, torch.bfloat16, kind), group, kind)


def _kernel_us(layers: list[tuple], x: dict) -> float:
    """us the kernel's products of `layers` (as _layer gives them) take on x ({K: rows [M, K]})."""
    return sum(timed(lambda: mi.mma(x[k], qw, sz, g, c)) for k, _, _, qw, sz, g, c in layers)


def products(result: dict, name: str, layers: list[tuple], rows: list[int]) -> None:
    """us one decoder layer's products at each row count: bf16, the Triton layer, the kernel."""
    if result["kernel"] == "built":  # the kernel's sums against its reference (the o projection)
        k, _, _, qw, sz, group, kind = layers[1]
        x = torch.randn(33, k, device="cuda").to(torch.bfloat16)
        want = mi.emulate(x.cpu(), qw.cpu(), sz.cpu(), group, torch.bfloat16, kind)
        got = mi.mma(x, qw, sz, group, kind).float().cpu()
        result["check"][name] = {"max_abs_err": (got - want).abs().max().item(), "mean_abs": want.abs().mean().item()}
        print(name, "check", result["check"][name], flush=True)
    per = result["rows"].setdefault(name, {})
    for m in rows:
        x = {k: torch.randn(m, k, device="cuda").to(torch.bfloat16) for k, *_ in layers}
        row = {"bf16": sum(timed(lambda: torch.nn.functional.linear(x[k], w)) for k, w, *_ in layers)}
        if layers[0][2] is not None:
            row["today"] = sum(timed(lambda: tri(x[k])) for k, _, tri, *_ in layers)
            row["today_vs_bf16"] = row["bf16"] / row["today"]
        if result["kernel"] == "built" and m <= mi.MAX_ROWS:
            row["mma"] = _kernel_us(layers, x)
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


def decode_steps(shape: str, rows: list[int], kinds: list[str], out: dict, save) -> None:
    """ms a decode step of the synthetic shape at each row count into `out` (saved after each):
    bf16, each kind on today's kernels and on the tensor-core kernel (twice each, alternating)."""
    from llamactl.bench.targets import load_targets
    from llamactl.options import RuntimeOptions
    from llamactl.runtime.step import Decoder

    dev = torch.device("cuda")
    for quant in ["none"] + kinds:
        model = load_targets([], shape, dev, "bfloat16", quant)[0].model
        for m in rows:
            tok = torch.zeros(m, dtype=torch.long, device=dev)
            sides = [("bf16", False)] if quant == "none" else [(f"{quant} today", False), (f"{quant} mma", True)] * 2
            for name, mma in sides:
                ms, warnings = step_ms(Decoder(model, m, 256, "graphs", options=RuntimeOptions(mma=mma)), tok)
                out.setdefault(str(m), {}).setdefault(name, []).append(ms)
                print(shape, m, name, round(ms, 3), warnings, flush=True)
                save()
        del model
        torch.cuda.empty_cache()


def split_sweep(result: dict, name: str, layers: list[tuple], rows: list[int], splits: list[int]) -> None:
    """us one decoder layer's kernel products at each split-K factor (blocks along K, each at
    least one chunk) beside the default (split_for's)."""
    default = mi.split_for
    per = result.setdefault("splits", {}).setdefault(name, {})
    for m in rows:
        x = {k: torch.randn(m, k, device="cuda").to(torch.bfloat16) for k, *_ in layers}
        row = {"default": _kernel_us(layers, x)}
        for split in splits:
            mi.split_for = lambda n, k, split=split: mi.spread(k // mi.CHUNK_K, split)
            try:
                row[str(split)] = _kernel_us(layers, x)
            finally:
                mi.split_for = default
        per[m] = row
        print(name, m, "splits", {k: round(v, 1) for k, v in row.items()}, flush=True)


if __name__ == "__main__":
    main()
